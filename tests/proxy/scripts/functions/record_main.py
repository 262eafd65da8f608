"""A torchrun-style entry point: ``@record`` (torch.distributed.elastic's error recorder) on
``main()``, argparse, the loop in a method. The wrapper stood between the top level and every
loop, so no safe point of the job was usable; a restore now calls it again on its way back in."""
import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record


class Trainer:
    def __init__(self):
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def fit(self, epochs):
        for epoch in range(epochs):
            for step in range(4):
                loss = self.model(torch.randn(8, 3)).pow(2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                print("train", epoch, step, f"{loss.item():.8f}")


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    Trainer().fit(args.epochs)
    for k in range(3):
        print("after", k, torch.rand(1).item())


if __name__ == "__main__":
    main()
