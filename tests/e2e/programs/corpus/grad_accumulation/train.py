# Gradient accumulation: four micro-batches per optimizer step, so gradients live across steps.
import argparse
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--micro-batches", type=int, default=24)
p.add_argument("--accumulate", type=int, default=4)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

torch.manual_seed(2)
model = nn.Sequential(nn.Linear(5, 10), nn.Tanh(), nn.Linear(10, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
opt.zero_grad()
for i in range(args.micro_batches):
    x = torch.randn(4, 5)
    loss = model(x).pow(2).mean() / args.accumulate
    loss.backward()
    grad_norm = sum(p.grad.norm() ** 2 for p in model.parameters()).sqrt()
    print(f"micro {i} loss {loss.item()!r} accumulated {grad_norm.item()!r}", flush=True)
    if (i + 1) % args.accumulate == 0:
        opt.step()
        opt.zero_grad()
    time.sleep(args.sleep)
torch.save(model.state_dict(), "model.pt")
