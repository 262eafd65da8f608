"""How long a periodic checkpoint stops the training loop, beside an in-memory copy of the state.

    python bench/periodic.py [--sizes 100,500] [--every 1.0] [--steps 120] [--ranks 1] [--device cuda]

A script holding ``size`` MB of float32 tensors runs a loop of fixed steps (a small matmul,
~10 ms) under the engine with ``--checkpoint-every``; each step's duration is printed.  A step
that took a checkpoint is longer than the median step by the stall.  Side by side in one run:

* ``in line``: the checkpoint is written at the safe point (``--write-in-line``, as before);
* ``behind``: the state is pickled into memory at the safe point and written behind the loop;
* ``memcpy``: copying the same tensors in memory (``torch.Tensor.clone``), the floor.

With ``--ranks W`` (W > 1) the same loop runs as a data-parallel job of W ranks on a one-node
LocalCluster (one CPU slot per rank, an ``all_reduce`` per step, so a rank's stall stalls them
all), each rank holding ``size`` MB; ``in line`` is the job's ``SINGULARITY_WRITE_IN_LINE=1``.

Reported: the median stall of the steps that took a checkpoint (their excess over the median
step), the time the safe point itself held the loop (``checkpointed``'s ``snapshot_s``, or the
whole write in line), and the stall's ratio to the memcpy.
Target (checkpoint I/O issue): behind ≤ 1.1 × memcpy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import time, torch
torch.manual_seed(0)
device = "{device}"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
state = [torch.rand(4 << 20, device=device) for _ in range({chunks})]   # 16 MiB each
x = torch.rand(256, 256, device=device)
# the floor: an in-memory copy of the same tensors; on a GPU, into page-locked memory kept for it
floor = [torch.empty(4 << 20, pin_memory=True) for _ in state] if device == "cuda" else None
for i in range(5):
    sync()
    t = time.perf_counter()
    copies = [s.clone() for s in state] if floor is None else [f.copy_(s) for f, s in zip(floor, state)]
    sync()
    copies = []
    print(json.dumps({{"memcpy": time.perf_counter() - t}}), flush=True)
floor = None
for step in range({steps}):
    t = time.perf_counter()
    deadline = t + 0.010
    while time.perf_counter() < deadline:
        y = x @ x
        sync()
    state[step % len(state)][0] += 1.0
    sync()
    print(json.dumps({{"step": step, "s": time.perf_counter() - t}}), flush=True)
'''


def run(size_mb: int, every: float, steps: int, in_line: bool, folder: Path, device: str = "cpu") -> dict:
    chunks = max(1, round(size_mb / 16.777216))
    script = folder / f"periodic-{size_mb}.py"
    script.write_text("import json\n" + SCRIPT.format(chunks=chunks, steps=steps, device=device))
    args = [sys.executable, "-m", "backend.proxy", str(script), "--checkpoint-dir", str(folder / f"ck-{size_mb}-{in_line}"),
            "--checkpoint-every", str(every)] + (["--write-in-line"] if in_line else [])
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    memcpy = min(d["memcpy"] for d in lines if "memcpy" in d)
    step_s = [d["s"] for d in lines if "step" in d]
    events = [line for line in out.stderr.splitlines() if line.startswith("[proxy] checkpoint_started")]
    done = [json.loads(line.split(" ", 2)[2]) for line in out.stderr.splitlines()
            if line.startswith("[proxy] checkpointed ")]
    snapshot = statistics.median(d.get("snapshot_s", d["seconds"]) for d in done) if done else 0.0
    median = statistics.median(step_s)
    # the steps that took a checkpoint are the longest ones, one per checkpoint started
    stalls = sorted(s - median for s in step_s)[-len(events):] if events else [0.0]
    return {"memcpy": memcpy, "median_step": median, "stall": statistics.median(stalls), "checkpoints": len(events),
            "at_safe_point": snapshot}


DDP_SCRIPT = '''
import json, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
state = [torch.rand(4 << 20) for _ in range({chunks})]   # 16 MiB each
x = torch.rand(256, 256)
one = torch.ones(1)
for i in range(5):  # every rank alike: the same safe points on every rank (docs/distributed.md)
    t = time.perf_counter()
    copies = [s.clone() for s in state]
    copies = []
    if dist.get_rank() == 0:
        print(json.dumps({{"memcpy": time.perf_counter() - t}}), flush=True)
for step in range({steps}):
    t = time.perf_counter()
    for _ in range(24):  # a fixed amount of work (~10 ms), not a time budget
        y = x @ x
    state[step % len(state)][0] += 1.0
    dist.all_reduce(one)
    if dist.get_rank() == 0:
        print(json.dumps({{"step": step, "s": time.perf_counter() - t}}), flush=True)
dist.destroy_process_group()
'''


def run_ddp(size_mb: int, every: float, steps: int, in_line: bool, ranks: int) -> dict:
    """The loop as a data-parallel job of ``ranks`` ranks through the service (rank 0's figures)."""
    from singularity_sdk import EventType, JobState, LocalCluster

    chunks = max(1, round(size_mb / 16.777216))
    env = {"SINGULARITY_WRITE_IN_LINE": "1"} if in_line else {}
    with LocalCluster(nodes=1, devices_per_node=ranks) as cluster, cluster.client() as client:
        job = client.submit(DDP_SCRIPT.format(chunks=chunks, steps=steps), gpus=ranks, checkpoint_every=every,
                            env=env, name=f"periodic-{size_mb}")
        if job.wait(600) != JobState.SUCCEEDED:
            raise SystemExit(f"the job failed: {job.info.error}")
        events = list(job.events(follow=False))
    lines = [json.loads(line) for e in events if e.data.get("stream") == "stdout"
             for line in e.lines if line.startswith("{")]
    memcpy = min(d["memcpy"] for d in lines if "memcpy" in d)
    step_s = [d["s"] for d in lines if "step" in d]
    done = [e.data for e in events if e.type == EventType.CHECKPOINTED]
    started = [e for e in events if e.type == EventType.CHECKPOINT_STARTED and e.data.get("rank", 0) == 0]
    median = statistics.median(step_s)
    stalls = sorted(s - median for s in step_s)[-len(started):] if started else [0.0]
    snapshot = statistics.median(d.get("snapshot_s", d["seconds"]) for d in done) if done else 0.0
    return {"memcpy": memcpy, "median_step": median, "stall": statistics.median(stalls),
            "checkpoints": len(started), "at_safe_point": snapshot}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,500")
    p.add_argument("--every", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--ranks", type=int, default=1, help="W > 1: a data-parallel job of W ranks through the service")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the one-rank job's tensors live (cuda: the floor is a copy into page-locked memory)")
    args = p.parse_args()
    if args.device == "cuda" and args.ranks > 1:
        p.error("--device cuda is for the one-rank job (the data-parallel one runs on CPU slots)")
    if args.ranks > 1:
        sys.path.insert(0, str(ROOT))
    print(f"{'size':>7} {'writer':>8} {'ckpts':>6} {'step':>9} {'stall':>9} {'at safe pt':>11} {'memcpy':>9} "
          f"{'stall/memcpy':>13}")
    with tempfile.TemporaryDirectory(prefix="sg-periodic-", dir=ROOT) as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            for in_line in (True, False):
                r = run_ddp(size, args.every, args.steps, in_line, args.ranks) if args.ranks > 1 else \
                    run(size, args.every, args.steps, in_line, Path(tmp), args.device)
                print(f"{size:>4} MB {'in line' if in_line else 'behind':>8} {r['checkpoints']:>6} "
                      f"{r['median_step'] * 1e3:>6.1f} ms {r['stall'] * 1e3:>6.1f} ms {r['at_safe_point'] * 1e3:>8.1f} ms "
                      f"{r['memcpy'] * 1e3:>6.1f} ms "
                      f"{r['stall'] / r['memcpy']:>12.2f}x")


if __name__ == "__main__":
    main()
