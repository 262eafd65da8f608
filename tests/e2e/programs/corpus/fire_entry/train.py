# fire.Fire(main) as the entry point, with the shapes around a loop that a checkpoint used to
# refuse or could not reach: a multiprocessing Pool for preprocessing (ended before the loop,
# still bound), a @contextmanager of the script's own and an ExitStack-held log around the loop,
# and an evaluate() under @torch.no_grad().
import contextlib
import multiprocessing as mp
import time

import fire
import torch
from torch import nn


def normalise(row):
    mean = sum(row) / len(row)
    return [v - mean for v in row]


@contextlib.contextmanager
def phase(name):
    print(f"begin {name}", flush=True)
    try:
        yield name
    finally:
        print(f"end {name}", flush=True)


class Trainer:
    def __init__(self, data, lr):
        torch.manual_seed(0)
        self.x = data
        self.y = data.sum(dim=1, keepdim=True).cos()
        self.model = nn.Sequential(nn.Linear(data.shape[1], 16), nn.Tanh(), nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self):
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, batches, sleep):
        total = 0.0
        for i in range(batches):
            x = self.x[i::batches]
            total += nn.functional.mse_loss(self.model(x), self.y[i::batches]).item()
            time.sleep(sleep)
        return total / batches


def main(steps: int = 12, lr: float = 0.03, sleep: float = 0.0):
    rows = torch.randn(48, 4, generator=torch.Generator().manual_seed(1)).tolist()
    with mp.Pool(2) as pool:
        data = torch.tensor(pool.map(normalise, rows))
    trainer = Trainer(data, lr)
    with phase("train") as name, contextlib.ExitStack() as stack:
        log = stack.enter_context(open("train.log", "w"))
        for step in range(steps):
            loss = trainer.step()
            print(f"{name} step {step} loss {loss!r}", file=log, flush=True)
            val = trainer.evaluate(3, sleep / 3) if step % 3 == 2 else None
            print(f"step {step} loss {loss!r} eval {val!r} grad {torch.is_grad_enabled()}", flush=True)
            time.sleep(sleep)
    torch.save(trainer.model.state_dict(), "model.pt")
    print("done", pool is not None, flush=True)


if __name__ == "__main__":
    fire.Fire(main)
