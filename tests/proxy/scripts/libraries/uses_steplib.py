import random

from steplib import Loop

random.seed(3)
loop = Loop(3, 5)
print("result", loop.fit(7))
