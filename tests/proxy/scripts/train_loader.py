"""Nested epoch/batch loops over a shuffled DataLoader with dropout, Adam and an LR scheduler.

`NUM_WORKERS` (env) picks single- or multi-process loading.  The dataset adds per-sample noise
from torch's RNG, so exact resume needs the loader's RNG handled right.
"""
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
NUM_WORKERS = int(os.environ.get("NUM_WORKERS", "0"))


class Noisy(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 4)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i]


loader = DataLoader(Noisy(48), batch_size=8, shuffle=True, num_workers=NUM_WORKERS)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
loss_fn = nn.BCEWithLogitsLoss()

for epoch in range(3):
    model.train()
    for step, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        sched.step()
        print(f"epoch {epoch} step {step} loss {loss.item():.10f} lr {sched.get_last_lr()[0]:.6f}")
    with torch.no_grad():
        model.eval()
        acc = ((model(loader.dataset.x) > 0).float() == loader.dataset.y).float().mean().item()
    print(f"epoch {epoch} acc {acc:.6f}")
print("final", sum(p.sum().item() for p in model.parameters()))
