# A data-parallel script in the shape people write: argparse, main(), epochs of DDP steps, a
# validation pass only rank 0 runs (no collectives), then a barrier so the others wait for it.
# Nothing in it knows about the proxy.
import argparse
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def validate(model: nn.Module, batches: int) -> float:
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            total += model(x).pow(2).mean().item()
    return total / batches


def main() -> str:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    for epoch in range(args.epochs):
        for step in range(args.steps):
            loss = ddp(torch.randn(8, 16, generator=data)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"epoch {epoch} step {step} loss {loss.item()!r}", flush=True)
            time.sleep(args.step_sleep)
        if rank == 0:
            print(f"epoch {epoch} validation {validate(model, 6 + epoch)!r}", flush=True)
        dist.barrier()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"rank {rank} params {digest}", flush=True)
    dist.destroy_process_group()
    return digest


if __name__ == "__main__":
    main()
