# Weights & Biases logging, offline into a relative wandb/ folder: a loop in main(), the
# learning rate read back from wandb.config, an epoch row opened with commit=False and closed
# after its batches, a summary, the model saved at the end.
import argparse
import time

import torch
import wandb
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    torch.manual_seed(7)
    run = wandb.init(project="corpus", mode="offline", config=vars(args), dir=".")
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=wandb.config.lr)
    best = float("inf")
    for epoch in range(args.epochs):
        wandb.log({"epoch": epoch}, commit=False)
        total = 0.0
        for batch in range(args.batches):
            x = torch.randn(16, 4)
            loss = (model(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            print(f"epoch {epoch} batch {batch} loss {loss.item()!r}", flush=True)
            time.sleep(args.sleep)
        wandb.log({"train/loss": total / args.batches, "weight0": model.weight[0, 0].item()})
        if total < best:
            best = total
            run.summary["best_total"] = best
        print(f"epoch {epoch} logged at step {run.step}", flush=True)
    torch.save(model.state_dict(), "model.pt")
    run.finish()


if __name__ == "__main__":
    main()
