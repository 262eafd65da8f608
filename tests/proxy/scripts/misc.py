"""Control flow and state the engine must carry across a restore.

while with a counter; numpy and python random in loops; classes, functions and lambdas defined
here; loops inside if / with / try; an if whose condition flips inside its own body; enumerate,
zip and a generator created in the for statement; a function that rebinds a global.
"""
import random

import numpy as np
import torch

random.seed(1)
np.random.seed(2)
torch.manual_seed(3)


class Accumulator:
    def __init__(self, scale):
        self.scale = scale
        self.total = 0.0

    def add(self, v):
        self.total += self.scale * v
        return self.total


def squares(n):
    for i in range(n):
        yield i * i


calls = 0


def bump():
    global calls
    calls += 1
    return calls


acc = Accumulator(0.5)
double = lambda v: 2 * v  # noqa: E731
shared = torch.zeros(3)
alias = shared  # the same tensor under two names must stay one tensor

count = 0
while count < 4:
    count += 1
    r = random.random()
    print("while", count, round(r, 12), acc.add(double(r)))

armed = True
if armed:
    for i in range(4):
        armed = False  # re-evaluating the condition on restore would now skip the loop
        shared += np.random.rand()
        print("if-loop", i, alias.tolist(), bump())

with torch.no_grad():
    for i, sq in enumerate(squares(5)):
        w = torch.randn(2)
        print("with-gen", i, sq, w.tolist(), torch.is_grad_enabled())

try:
    for a, b in zip("xyz", [10, 20, 30]):
        print("try-zip", a, b, random.randint(0, 100))
    for key, value in {"p": 1, "q": 2}.items():
        print("items", key, value)
except ZeroDivisionError:
    print("never")
finally:
    print("finally ran once")

for outer in range(2):
    for inner in range(3):
        if (outer + inner) % 2:
            print("nested", outer, inner, np.random.randint(1000))
        else:
            continue
    print("outer done", outer, shared is alias)

print("calls", calls, "acc", acc.total, type(acc).__name__)
[count, calls]
