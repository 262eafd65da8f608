# A Trainer class: fit() runs epochs, train_epoch() runs the batches of one epoch; after each
# epoch the history so far is pickled (records of a dataclass of the script, dicts of metrics).
import argparse
import dataclasses
import pickle
import time

import torch
from torch import nn


@dataclasses.dataclass
class EpochRecord:
    epoch: int
    mean: float


class Trainer:
    def __init__(self, model, lr, sleep):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.sleep = sleep
        self.history = []
        self.records = []

    def train_epoch(self, epoch, batches):
        self.model.train()
        total = 0.0
        for i, (x, y) in enumerate(batches):
            self.opt.zero_grad()
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            total += loss.item()
            print(f"epoch {epoch} batch {i} loss {loss.item()!r}", flush=True)
            time.sleep(self.sleep)
        return total / len(batches)

    def fit(self, epochs, batches):
        for epoch in range(epochs):
            mean = self.train_epoch(epoch, batches)
            self.history.append(mean)
            self.records.append((EpochRecord(epoch, mean), {"epoch": epoch, "train/loss": mean}))
            with open("records.pkl", "wb") as f:
                pickle.dump(self.records, f)
            print(f"epoch {epoch} mean {mean!r}", flush=True)
        return self.history


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(1)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(6)]
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.ReLU(), nn.Linear(12, 3))
    trainer = Trainer(model, lr=0.05, sleep=args.sleep)
    history = trainer.fit(args.epochs, data)
    torch.save({"model": model.state_dict(), "history": history}, "trainer.pt")


if __name__ == "__main__":
    main()
