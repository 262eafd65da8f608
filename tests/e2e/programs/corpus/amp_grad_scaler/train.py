# Mixed precision on the CPU: autocast to bfloat16 and a GradScaler.
import argparse
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

torch.manual_seed(4)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
for step in range(args.steps):
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)
    time.sleep(args.sleep)
torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, "amp.pt")
