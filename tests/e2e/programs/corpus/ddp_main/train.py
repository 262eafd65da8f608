# A torchrun-style DDP script with its loop in main(): run as
#   torchrun --nproc_per_node 2 train.py --steps 20
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        loss = (model(x) - x[:, :1]).pow(2).mean()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
