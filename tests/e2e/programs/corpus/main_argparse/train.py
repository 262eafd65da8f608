# The most common shape: argparse, the loop in main(), called under `if __name__ == "__main__":`.
import argparse
import time

import torch
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description="a small regression")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--sleep", type=float, default=0.0)
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True).sin()
    model = nn.Sequential(nn.Linear(4, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")
    print("done", flush=True)


if __name__ == "__main__":
    main()
