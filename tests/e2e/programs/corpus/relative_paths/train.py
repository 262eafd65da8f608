# Relative data and output paths: reads data/x.csv, writes out/model.pt and out/log.txt.
import argparse
import csv
import os
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

with open("data/x.csv", newline="") as f:
    rows = [[float(v) for v in row] for row in list(csv.reader(f))[1:]]
data = torch.tensor(rows)
x, y = data[:, :2], data[:, 2:]
torch.manual_seed(7)
model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
os.makedirs("out", exist_ok=True)
for step in range(args.steps):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    with open("out/log.txt", "a") as log:
        log.write(f"{step},{loss.item():.12f}\n")
    print(f"step {step} loss {loss.item()!r}", flush=True)
    time.sleep(args.sleep)
torch.save(model.state_dict(), "out/model.pt")
