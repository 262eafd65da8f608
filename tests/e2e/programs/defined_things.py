# Classes, functions and lambdas defined in the code itself survive a checkpoint.
import time

import torch


class Accumulator:
    def __init__(self, scale):
        self.scale = scale
        self.values = []

    def add(self, v):
        self.values.append(v * self.scale)
        return sum(self.values)


def noisy(step):
    return torch.randn(3).sum().item() + step


square = lambda v: v * v  # noqa: E731
torch.manual_seed(5)
acc = Accumulator(0.5)
shared = torch.zeros(4)
alias = shared  # one tensor under two names stays one tensor
for step in range(30):
    total = acc.add(square(noisy(step)))
    alias += step
    print(f"step {step} total {total:.10f} shared {shared.sum().item()} same {alias is shared}", flush=True)
    time.sleep(0.02)
total
