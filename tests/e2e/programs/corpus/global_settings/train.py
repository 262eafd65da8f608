# Settings made once at the top of main(), which live in libraries rather than in variables:
# logging to a file, float64 as the default dtype, print precision, sys.stdout replaced by a tee
# that also writes console.log. A restore does not run these lines again, so the process they
# are put back in must get them from the checkpoint.
import argparse
import logging
import sys
import time

import numpy as np
import torch
from torch import nn

log = logging.getLogger("train")


class Tee:
    """Prints to the terminal and to a file."""

    def __init__(self, path: str) -> None:
        self.terminal = sys.stdout
        self.file = open(path, "w")

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.terminal.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()

    sys.stdout = Tee("console.log")
    logging.basicConfig(filename="train.log", filemode="w", level=logging.INFO,
                        format="%(name)s %(levelname)s %(message)s")
    torch.set_default_dtype(torch.float64)
    torch.set_printoptions(precision=12)
    np.set_printoptions(precision=3, suppress=True)
    torch.manual_seed(5)
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randn(24, 3)
    y = x.sum(dim=1, keepdim=True)
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        third = torch.ones(2) / 3  # float64 only while the default dtype is
        log.info("step %d loss %r", step, loss.item())
        print(step, loss.detach(), third, model.weight.detach().numpy() * 1000, flush=True)
        time.sleep(args.sleep)
    torch.save(model.state_dict(), "model.pt")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
