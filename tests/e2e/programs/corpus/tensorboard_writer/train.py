# TensorBoard logging of scalars to a relative runs/ folder.
import argparse
import time

import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

torch.manual_seed(6)
writer = SummaryWriter("runs/exp")
model = nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
for step in range(args.steps):
    x = torch.randn(16, 4)
    loss = (model(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    writer.add_scalar("train/loss", loss.item(), step)
    writer.add_scalar("train/weight0", model.weight[0, 0].item(), step)
    print(f"step {step} loss {loss.item()!r}", flush=True)
    time.sleep(args.sleep)
writer.close()
torch.save(model.state_dict(), "model.pt")
