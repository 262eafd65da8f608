"""A small but real training loop: an MLP learns which points lie inside a circle, printing
its loss every step.

Deterministic (seeded), so two runs print the same losses bit for bit, which is how the demo
shows that a preempted, resumed and migrated run matches an uninterrupted one.
"""
import time

import torch
from torch import nn

torch.manual_seed(0)
n = 512
x = torch.rand(n, 2) * 2 - 1
labels = ((x ** 2).sum(dim=1) < 0.45).float()

model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.02)
loss_fn = nn.BCEWithLogitsLoss()

losses = []
for step in range(80):
    idx = torch.randint(0, n, (128,))
    opt.zero_grad()
    loss = loss_fn(model(x[idx]).squeeze(1), labels[idx])
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step {step:3d} loss {loss.item():.6f}")
    time.sleep(0.05)  # paced so that a person can watch the demo preempt and move it

with torch.no_grad():
    accuracy = ((model(x).squeeze(1) > 0).float() == labels).float().mean().item()
print(f"final accuracy {accuracy:.3f}")
{"final_loss": losses[-1], "accuracy": accuracy}
