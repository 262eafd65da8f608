# Logs kept open across the loop inside main(): a CSV table written through csv.DictWriter into
# a `with open(..., "w")` around the loop, and a text log opened before it and closed after it.
# Both must read as the uninterrupted run's.
import argparse
import csv
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
    log = open(os.path.join(args.out, "log.txt"), "w")
    log.write(f"training for {args.steps} steps\n")
    with open(os.path.join(args.out, "metrics.csv"), "w", newline="") as f:
        table = csv.DictWriter(f, fieldnames=["step", "loss"])
        table.writeheader()
        for step in range(args.steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            table.writerow({"step": step, "loss": repr(loss.item())})
            log.write(f"step {step}: {loss.item():.10f}\n")
            print(f"step {step} loss {loss.item()!r}", flush=True)
            time.sleep(args.sleep)
    log.write("done\n")
    log.close()
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
