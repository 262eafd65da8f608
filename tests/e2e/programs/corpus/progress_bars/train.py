# tqdm progress bars: one over all steps held in a variable and updated by hand, one wrapping
# the DataLoader of each epoch (re-made by the loop's own expression).
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(48, 3), torch.randn(48, 1))
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overall = tqdm(total=args.epochs * len(loader), desc="training", unit="batch")
    for epoch in range(args.epochs):
        for x, y in tqdm(loader, desc=f"epoch {epoch}", leave=False):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            overall.update(1)
            overall.set_postfix(loss=f"{loss.item():.4f}")
            print(epoch, overall.n, repr(loss.item()), flush=True)
            time.sleep(args.sleep)
    overall.close()
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
