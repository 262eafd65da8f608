# LBFGS, which needs a closure that re-evaluates the loss (its `loss` is its own, not main's).
import argparse
import time

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(3)
    x = torch.linspace(-2, 2, 50, dtype=torch.float64).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    model = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1)).double()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=10)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for step in range(args.steps):
        loss = opt.step(closure)
        print(f"step {step} loss {loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
