# Imports its model and data from a sibling module, which also replaces print (rank 0 only) and
# keeps a summary printed by __del__ when the interpreter exits.
import argparse
import time

import torch

from helpers import RunSummary, batch, make_model, setup_for_distributed

summary = RunSummary()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    setup_for_distributed(True)
    torch.manual_seed(8)
    model = make_model(16)
    gen = torch.Generator().manual_seed(80)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x, y = batch(gen)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        summary.losses.append(loss.item())
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
