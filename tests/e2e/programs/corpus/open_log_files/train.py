# Logs kept open across the loop inside main(): a `with open(..., "w")` around it, and a metrics
# file opened before it and closed after it. Both must read as the uninterrupted run's.
import argparse
import os
import time

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default="runs/a")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(3)
    x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = open(os.path.join(args.out, "metrics.csv"), "w")
    metrics.write("step,loss\n")
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        log.write(f"training for {args.steps} steps\n")
        for step in range(args.steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            log.write(f"step {step}: {loss.item():.10f}\n")
            metrics.write(f"{step},{loss.item()!r}\n")
            print(f"step {step} loss {loss.item()!r}", flush=True)
            time.sleep(args.sleep)
        log.write("done\n")
    metrics.close()
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
