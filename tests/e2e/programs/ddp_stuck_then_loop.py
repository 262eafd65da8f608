# A data-parallel job whose ranks all spend a long time in a library call before their loop.
import os
import time

import torch
import torch.distributed as dist


def warm_up():
    time.sleep(float(os.environ.get("STUCK_S", "0")))


dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} warming up", flush=True)
warm_up()
for step in range(int(os.environ.get("STEPS", "40"))):
    t = torch.full((1,), float(step + rank))
    dist.all_reduce(t)
    print(f"step {step} sum {t.item()!r}", flush=True)
    time.sleep(0.05)
dist.destroy_process_group()
"ok"
