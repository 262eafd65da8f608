import random


def epochs(n):
    return range(n)


class Trainer:
    def __init__(self, batches):
        self.batches = batches
        self.total = 0.0

    def run_epoch(self, epoch):
        loss = 0.0
        for b in range(self.batches):
            x = random.random() * (epoch + 1)
            loss += x
            print(f"  batch {b} x {x!r}")
        self.total += loss
        return loss
