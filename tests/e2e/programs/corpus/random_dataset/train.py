# A DataLoader over a user-defined Dataset that draws randomness in __getitem__ (augmentation).
import argparse
import random
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class NoisyDataset(Dataset):
    def __init__(self, n):
        self.x = torch.linspace(-1, 1, n).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.05 * torch.randn(1)
        if random.random() < 0.5:
            x = -x
        return x, x.abs()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    random.seed(10)
    torch.manual_seed(10)
    loader = DataLoader(NoisyDataset(48), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.l1_loss(model(x), y)
            loss.backward()
            opt.step()
            print(f"epoch {epoch} batch {i} loss {loss.item()!r}", flush=True)
            time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
