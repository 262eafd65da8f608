"""A small but real training loop: an MLP learns a noisy 2-D spiral, printing its loss every step.

Deterministic (seeded), so two runs print the same losses bit for bit, which is how the demo
shows that a preempted and resumed run matches an uninterrupted one.
"""
import math

import torch
from torch import nn

torch.manual_seed(0)
n = 512
t = torch.linspace(0, 4 * math.pi, n)
labels = (torch.arange(n) % 2).float()
radius = t / (4 * math.pi)
sign = labels * 2 - 1
x = torch.stack([radius * torch.cos(t) * sign, radius * torch.sin(t) * sign], dim=1)
x = x + 0.02 * torch.randn_like(x)

model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
loss_fn = nn.BCEWithLogitsLoss()

losses = []
for step in range(60):
    idx = torch.randint(0, n, (128,))
    opt.zero_grad()
    loss = loss_fn(model(x[idx]).squeeze(1), labels[idx])
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step {step:3d} loss {loss.item():.6f}")

accuracy = ((model(x).squeeze(1) > 0).float() == labels).float().mean().item()
print(f"final accuracy {accuracy:.3f}")
{"final_loss": losses[-1], "accuracy": accuracy}
