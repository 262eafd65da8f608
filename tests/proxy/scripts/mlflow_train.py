"""A script tracked with MLflow, in the shape people write: argparse, the loop in ``main()``, a
tracking URI and experiment set up front, ``with mlflow.start_run(...)`` around the epochs with
parameters and a tag, a metric per epoch at its step, and a run nested in it per epoch whose
batches log at their own steps."""
import argparse

import mlflow
import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="mlruns")
    args = parser.parse_args()
    torch.manual_seed(0)
    mlflow.set_tracking_uri(f"file:{args.out}")
    mlflow.set_experiment("singularity-test")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = torch.randn(48, 4), torch.randn(48, 1)
    with mlflow.start_run(run_name="fit") as run:
        mlflow.log_params({"epochs": args.epochs, "lr": args.lr})
        mlflow.set_tag("model", "linear")
        for epoch in range(args.epochs):
            with mlflow.start_run(run_name=f"epoch-{epoch}", nested=True):
                for batch, i in enumerate(range(0, 48, 16)):
                    loss = torch.nn.functional.mse_loss(model(x[i:i + 16]), y[i:i + 16])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    mlflow.log_metric("batch_loss", loss.item(), step=batch)
            with torch.no_grad():
                val = torch.nn.functional.mse_loss(model(x), y).item()
            mlflow.log_metric("val_loss", val, step=epoch)
            print(f"epoch {epoch} val {val:.6f} active {mlflow.active_run().info.run_name}")
    print("ended", run.info.run_name, mlflow.active_run())


if __name__ == "__main__":
    main()
