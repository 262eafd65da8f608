# Nested epoch/batch loops over a shuffled DataLoader, dropout, Adam, an LR scheduler.
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(1)
X = torch.randn(96, 8)
Y = (X.sum(dim=1, keepdim=True) > 0).float()
workers = int(os.environ.get("LOADER_WORKERS", "0"))
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True, num_workers=workers)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.05)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
loss_fn = nn.BCEWithLogitsLoss()
history = []
for epoch in range(3):
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        history.append(loss.item())
        print(f"epoch {epoch} batch {i} loss {loss.item():.10f} lr {sched.get_last_lr()[0]:.6f}", flush=True)
        time.sleep(0.03)
    sched.step()
    print(f"epoch {epoch} done", flush=True)
print("params", float(sum(p.double().sum() for p in model.parameters())))
history
