# Fine-tuning: a frozen backbone (two 1 MiB weights, requires_grad=False) and a trained head.
# Its checkpoints write the backbone once and link it afterwards; the output must not notice.
import time

import torch

torch.manual_seed(3)
backbone = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 64))
backbone.requires_grad_(False)
head = torch.nn.Linear(64, 1)
opt = torch.optim.Adam(head.parameters(), lr=1e-2)
for step in range(40):
    x = torch.randn(16, 64)
    loss = (head(backbone(x)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.8f}", flush=True)
    time.sleep(0.05)
result = head.weight.sum().item()
