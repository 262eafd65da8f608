# An "infinite" loader: a wrapper holding a live DataLoader iterator, advanced with next(); its
# workers persist across epochs and add noise to each sample (a random augmentation).
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn_like(self.x[i]), self.y[i]


class InfiniteLoader:
    def __init__(self, dataset, batch_size, workers):
        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                 persistent_workers=workers > 0)
        self.it = iter(self.loader)
        self.epoch = 0

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.it = iter(self.loader)
            return next(self.it)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(5)
    ds = Noisy(torch.randn(40, 3), torch.randn(40, 1))
    batches = InfiniteLoader(ds, batch_size=8, workers=args.workers)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x, y = batches.next()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} epoch {batches.epoch} first {x[0, 0].item()!r} loss {loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
