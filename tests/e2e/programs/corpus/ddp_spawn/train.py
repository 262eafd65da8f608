# The shape of PyTorch's "Getting Started with DDP" tutorial: a parent that spawns one process
# per rank with torch.multiprocessing.spawn, each setting MASTER_ADDR/MASTER_PORT itself and
# joining the group with its rank; run as
#   python train.py --world-size 2 --steps 16
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29533"  # a fixed port, as in the tutorial
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def demo_basic(rank, world_size, args):
    setup(rank, world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        optimizer.zero_grad()
        outputs = model(torch.randn(20, 10, generator=data))
        loss = loss_fn(outputs, torch.randn(20, 5, generator=data))
        loss.backward()
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    mp.spawn(demo_basic, args=(args.world_size, args), nprocs=args.world_size, join=True)
    print("all ranks done", flush=True)
