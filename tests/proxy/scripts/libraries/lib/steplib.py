"""A stand-in for an installed trainer library (found through PYTHONPATH, not next to the script).

Its loop is reached as a trainer library's is: through a ``functools.partial`` (transformers'
``find_executable_batch_size``) and a method call spanning several lines."""
import functools
import random


class Loop:
    def __init__(self, epochs, batches):
        self.epochs = epochs
        self.batches = batches
        self.total = 0.0

    def fit(self, seed):
        run = functools.partial(self._run, scale=2)
        return run(seed)

    def _run(self, seed, scale=1):
        rng = random.Random(seed)
        for epoch in range(self.epochs):
            self.run_epoch(
                epoch,
                rng,
                scale,
            )
        return self.total

    def run_epoch(self, epoch, rng, scale):
        for b in range(self.batches):
            x = rng.random() * scale + random.random()
            self.total += x
            print(f"epoch {epoch} batch {b} x {x!r} total {self.total!r}")
