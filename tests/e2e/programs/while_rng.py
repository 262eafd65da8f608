# A while loop with a counter, python random and numpy drawing inside it, and a second loop after.
import random
import time

import numpy as np

random.seed(3)
np.random.seed(4)
total = 0.0
i = 0
while i < 40:
    a = random.random()
    b = float(np.random.rand())
    total += a * b
    print(f"i {i} a {a:.12f} b {b:.12f} total {total:.12f}", flush=True)
    i += 1
    time.sleep(0.02)
for j in range(10):
    total -= random.gauss(0, 1)
    print(f"j {j} total {total:.12f}", flush=True)
    time.sleep(0.02)
total
