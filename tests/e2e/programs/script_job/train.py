# A training script the way people write them: argparse, relative data and output paths, a
# sibling module, a chdir into a run folder and an environment variable set before the loop.
import argparse
import json
import os
import time

import torch
from torch import nn

from helpers import describe, load_points

parser = argparse.ArgumentParser()
parser.add_argument("--data", default="data/points.csv")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--run", default="runs/default")
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

points = torch.tensor(load_points(args.data))
x, y = points[:, :1], points[:, 1:]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

os.makedirs(args.run, exist_ok=True)
os.chdir(args.run)
os.makedirs("out", exist_ok=True)
os.environ["TRAIN_PHASE"] = "fit"
print("argv", json.dumps(vars(args), sort_keys=True), flush=True)

for step in range(args.steps):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(describe(step, loss.item(), os.environ["TRAIN_PHASE"]), flush=True)
    with open("out/losses.txt", "a") as f:
        f.write(f"{step} {loss.item():.10f}\n")
    if step % 5 == 4:
        torch.save(model.state_dict(), f"out/model-{step:03d}.pt")
    time.sleep(args.sleep)

torch.save(model.state_dict(), "model.pt")
print("saved", os.path.relpath(os.getcwd(), os.path.dirname(os.path.abspath(__file__))), flush=True)
