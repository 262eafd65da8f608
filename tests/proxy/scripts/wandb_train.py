"""A script logging to Weights & Biases (offline), in the shape people write: argparse, the loop in
``main()``, hyperparameters read back from ``wandb.config``, ``wandb.watch(model)``, a row opened
per epoch with ``commit=False`` and committed after the batches, an explicit summary,
``run.finish()``. With ``--explicit-steps``, every batch logs at its own global step and the
epoch's values join the last batch's row (``step=`` given: a row stays open until a later step
comes)."""
import argparse

import torch
import wandb


def evaluate(model, x, y):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="wandb-out")
    parser.add_argument("--explicit-steps", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    run = wandb.init(project="singularity-test", dir=args.out, mode="offline", config=vars(args), tags=["test"])
    config = wandb.config
    model = torch.nn.Linear(4, 1)
    wandb.watch(model, log="all", log_freq=2)  # hooks logging histograms of weights and gradients
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    x, y = torch.randn(48, 4), torch.randn(48, 1)
    best = float("inf")
    global_step = 0
    for epoch in range(config.epochs):
        if not args.explicit_steps:
            wandb.log({"epoch": epoch}, commit=False)  # the epoch's row stays open over the batches
        total = 0.0
        for i in range(0, 48, 16):
            loss = torch.nn.functional.mse_loss(model(x[i:i + 16]), y[i:i + 16])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            global_step += 1
            if args.explicit_steps:
                run.log({"batch/loss": loss.item()}, step=global_step)
        val = evaluate(model, x, y)
        if args.explicit_steps:
            run.log({"epoch": epoch, "val/loss": val}, step=global_step)
        else:
            wandb.log({"train/loss": total / 3, "val/loss": val})
        if val < best:
            best = val
            run.summary["best_val"] = best
        print(f"epoch {epoch} train {total / 3:.6f} val {val:.6f} step {run.step}")
    run.finish()


if __name__ == "__main__":
    main()
