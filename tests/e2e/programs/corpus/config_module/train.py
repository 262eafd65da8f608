# Module-level state: settings written into a config module from argparse, a counter in a helper
# module, and a model class from src/ reached through sys.path.insert.
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))

import torch  # noqa: E402

import config  # noqa: E402
import helpers  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    config.scale, config.lr = args.scale, args.lr

    from mylib import Model

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    x = torch.randn(8, 2)
    for step in range(args.steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        print(step, helpers.bump(), len(config.history), repr(loss.item()), flush=True)
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
