# A data-parallel loop whose ranks, once a marker file appears, tell the test (an ack file), give
# it time to send a request, and in the next step spend a long time in a library call: the
# request reached a safe point and spread to every rank with that step's allreduce, but the ranks
# reach their next safe point only after the call returns.
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
marker = os.environ["MARKER"]
seen_at = None
for step in range(int(os.environ.get("STEPS", "40"))):
    t = torch.tensor([float(step + rank), float(os.path.exists(marker))])
    dist.all_reduce(t)  # the ranks agree on the step at which the marker was seen
    print(f"step {step} sum {t[0].item()!r}", flush=True)
    if seen_at is None and t[1].item() > 0:
        seen_at = step
        if rank == 0:
            open(marker + ".ack", "w").close()
        time.sleep(1.5)
    elif seen_at is not None and step == seen_at + 1:
        time.sleep(float(os.environ.get("STUCK_S", "0")))
    time.sleep(0.3)
dist.destroy_process_group()
"ok"
