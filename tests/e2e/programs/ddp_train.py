# An ordinary torchrun-style data-parallel training script: nothing in it knows about the proxy.
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
hidden = int(os.environ.get("HIDDEN", "64"))  # 1024: weights and moments large enough to be blobs
model = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 8))
ddp = DDP(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1000 + rank)
steps = int(os.environ.get("STEPS", "60"))
for step in range(steps):
    x = torch.randn(16, 32, generator=data)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if rank == 0 and step % 7 == 0:  # work only rank 0 does (say, an evaluation): its loops add
        for _ in range(3):           # safe points the other ranks do not pass through
            pass
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.02")))
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {rank}/{world} params {digest}", flush=True)
dist.destroy_process_group()
digest
