"""The circle-learning MLP as an ordinary torchrun-style data-parallel script (DDP over gloo).

Nothing here knows about Singularity: run it with ``torchrun --nproc-per-node 4`` or submit it
with ``singularityctl submit examples/ddp_train.py --gpus 4``. Under Singularity the job keeps
its 4 ranks whatever devices it gets (``resize --gpus 2`` puts two ranks on each device), and
the losses it prints stay identical bit for bit.
"""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every rank
n = 512
x = torch.rand(n, 2) * 2 - 1
labels = ((x ** 2).sum(dim=1) < 0.45).float()

model = DDP(nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.02)
loss_fn = nn.BCEWithLogitsLoss()
batches = torch.Generator().manual_seed(rank)  # each rank draws its own batches

for step in range(80):
    idx = torch.randint(0, n, (128 // world,), generator=batches)
    opt.zero_grad()
    loss = loss_fn(model(x[idx]).squeeze(1), labels[idx])
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the loss over the whole global batch
    if rank == 0:
        print(f"step {step:3d} loss {mean.item() / world:.8f}", flush=True)
    time.sleep(0.05)  # paced so that a person can watch the demo resize it

with torch.no_grad():
    accuracy = ((model(x).squeeze(1) > 0).float() == labels).float().mean().item()
if rank == 0:
    print(f"final accuracy {accuracy:.3f}")
dist.destroy_process_group()
{"rank": rank, "accuracy": accuracy}
