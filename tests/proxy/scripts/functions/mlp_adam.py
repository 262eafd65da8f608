"""MLP + Adam training in main() with argparse defaults, a gradient step in a helper function."""
import argparse

import torch
from torch import nn


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--hidden", type=int, default=16)
    return p.parse_args()


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def main():
    args = get_args()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.randn(64, 4)
    target = data[:, :1] * 2 - data[:, 1:2]
    for step in range(args.steps):
        idx = torch.randint(0, 64, (16,))
        loss = train_step(model, opt, data[idx], target[idx])
        print(f"step {step} loss {loss:.10f}")
    print("weights", float(sum(p.detach().sum() for p in model.parameters())))


if __name__ == "__main__":
    main()
