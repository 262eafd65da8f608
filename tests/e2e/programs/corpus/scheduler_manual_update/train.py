# An LR scheduler driving a hand-written update that reads .grad (the optimizer
# only holds the lr and is never stepped).
import argparse
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

torch.manual_seed(9)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
for step in range(args.steps):
    x = torch.randn(10, 4)
    model.zero_grad()
    loss = (model(x) - x.prod(dim=1, keepdim=True)).pow(2).mean()
    loss.backward()
    lr = sched.get_last_lr()[0]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(-lr * param.grad)
    sched.step()
    print(f"step {step} lr {lr!r} loss {loss.item()!r}", flush=True)
    time.sleep(args.sleep)
torch.save(model.state_dict(), "model.pt")
