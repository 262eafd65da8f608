"""Cost of the singularity collective backend against plain gloo, on this machine's CPUs.

    python bench/collectives.py [--world 2 4] [--sizes-mb 1 4 16 64 100] [--seconds 1.0] [--splice]

For each world size W, W rank processes (one thread each) time ``all_reduce`` of a float32
tensor of each size through three groups created in the same job:

  gloo   a plain ``ProcessGroupGloo`` (torch's own ``new_group(backend="gloo")``): the reference;
  plain  the singularity wrapper forwarding to gloo (worker thread, flag word, placement);
  exact  the singularity wrapper's default: reduction in a tree fixed by logical rank
         (alltoall of chunks, tree evaluated per chunk, allgather: bitwise placement-independent).

Iterations alternate between the groups so drift on this shared machine hits all three.  The
table gives the median milliseconds per allreduce over the ranks' medians, the ratios to gloo
and the algorithm bandwidth (size / time).  ``--splice`` adds DDP step times with S ranks
per slot, each slot pinned to one core (a CPU "device"), against the ideal S x the time with
fewer ranks per slot, and the cost of one safe-point poll of the consistent cut.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.proxy.launch import launch, shared_warm_server  # noqa: E402
from backend.proxy.distributed.layout import RankLayout  # noqa: E402

MARK = "BENCH_COLLECTIVES "

RANK_SCRIPT = r'''
import json, statistics, sys, time
import torch, torch.distributed as dist
from backend.proxy.distributed.collectives import Options

sizes_mb, seconds = [float(s) for s in sys.argv[1].split(",")], float(sys.argv[2])
dist.init_process_group("gloo")
raw_new_group = getattr(dist.new_group, "__singularity_original__", dist.new_group)  # unwrapped gloo
groups = {"gloo": raw_new_group(backend="gloo"),
          "plain": dist.new_group(backend="singularity", pg_options=Options({"cpu": "gloo"}, "gloo", "plain")),
          "exact": None}
out = {}
for mb in sizes_mb:
    t = torch.randn(int(mb * 2**20 / 4))
    times = {k: [] for k in groups}
    for name, g in groups.items():  # warm-up (and first-use allocations)
        dist.all_reduce(t.clone(), group=g)
    deadline = time.monotonic() + seconds
    rounds = 0
    while True:  # every rank leaves at the same round (the MIN allreduce below)
        for name, g in groups.items():
            x = t.clone()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=g)
            times[name].append(time.perf_counter() - t0)
        rounds += 1
        flag = torch.tensor([1.0 if time.monotonic() < deadline or rounds < 3 else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=groups["gloo"])  # stop together
        if flag.item() == 0.0:
            break
    out[str(mb)] = {k: statistics.median(v) for k, v in times.items()}
print("BENCH_COLLECTIVES " + json.dumps(out))
dist.destroy_process_group()
'''

SPLICE_SCRIPT = r'''
import json, statistics, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
steps = int(sys.argv[1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 512)
times = []
for step in range(steps):
    t0 = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
print("BENCH_COLLECTIVES " + json.dumps({"step_s": statistics.median(times[3:])}))
dist.destroy_process_group()
'''


def _reports(results: list) -> list[dict]:
    out = []
    for r in results:
        if r.rc != 0:
            raise SystemExit(f"rank {r.rank} failed ({r.rc}):\n{r.stderr[-3000:]}")
        line = next(line for line in r.stdout.splitlines() if line.startswith(MARK))
        out.append(json.loads(line[len(MARK):]))
    return out


def allreduce_table(worlds: list[int], sizes: list[float], seconds: float, script: Path) -> None:
    print(f"{'W':>2} {'MB':>6} {'gloo ms':>9} {'plain ms':>9} {'exact ms':>9} {'plain/gloo':>10} "
          f"{'exact/gloo':>10} {'exact GB/s':>10}")
    for world in worlds:
        reports = _reports(launch(script, RankLayout.one_per_slot(world), warm=shared_warm_server(), timeout=600,
                                  args=[",".join(str(s) for s in sizes), str(seconds)]))
        for mb in sizes:
            med = {k: statistics.median(rep[str(mb)][k] for rep in reports) for k in ("gloo", "plain", "exact")}
            print(f"{world:>2} {mb:>6g} {med['gloo'] * 1e3:>9.2f} {med['plain'] * 1e3:>9.2f} "
                  f"{med['exact'] * 1e3:>9.2f} {med['plain'] / med['gloo']:>10.2f} "
                  f"{med['exact'] / med['gloo']:>10.2f} {mb / 1024 / med['exact']:>10.2f}", flush=True)


def splice_table(script: Path, steps: int) -> None:
    """Step time with S ranks per one-core slot against the ideal S x (fewest ranks per slot)."""
    ncpu = len(os.sched_getaffinity(0))
    print(f"{'W':>2} {'placement':>20} {'S':>2} {'slots':>5} {'step ms':>9} {'ratio':>6} {'ideal':>6} {'overhead':>8}")
    for world in (2, 4):
        base = None
        for per_slot in (1, 2, 4):
            slots = world // per_slot
            if per_slot > world or slots > ncpu or world % per_slot:
                continue
            placement = RankLayout.contiguous(world, per_slot)
            for turns in ("1", "0") if per_slot > 1 else ("1",):
                reports = _reports(launch(script, placement, args=[str(steps)], warm=shared_warm_server(),
                                          timeout=600, cpus_per_slot=1, env={"SINGULARITY_TURNS": turns}))
                step = statistics.median(rep["step_s"] for rep in reports)
                if base is None:
                    base = (step, per_slot)
                ratio, ideal = step / base[0], per_slot / base[1]
                label = placement.text() + ("" if turns == "1" else " (no turns)")
                print(f"{world:>2} {label:>20} {per_slot:>2} {slots:>5} {step * 1e3:>9.2f} {ratio:>6.2f} "
                      f"{ideal:>6.2f} {ratio / ideal - 1:>+8.1%}", flush=True)


def poll_cost() -> None:
    from backend.proxy.distributed.cut import ConsistentCut

    class Channel:
        def drain(self) -> None:
            pass

    cut = ConsistentCut(every=10**9)
    cut.attach(Channel())
    n = 200_000
    t0 = time.perf_counter()
    for step in range(n):
        cut.poll(step)
    print(f"consistent-cut poll at a safe point: {(time.perf_counter() - t0) / n * 1e9:.0f} ns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 100])
    p.add_argument("--seconds", type=float, default=1.0, help="timing budget per size and world")
    p.add_argument("--splice", action="store_true", help="also measure replica splicing and the cut's poll")
    p.add_argument("--splice-steps", type=int, default=30)
    p.add_argument("--no-allreduce", action="store_true", help="skip the allreduce table")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "bench_rank.py"
        script.write_text(RANK_SCRIPT)
        if not args.no_allreduce:
            allreduce_table(args.world, args.sizes_mb, args.seconds, script)
        if args.splice:
            splice = Path(tmp) / "bench_splice.py"
            splice.write_text(SPLICE_SCRIPT)
            splice_table(splice, args.splice_steps)
            poll_cost()


if __name__ == "__main__":
    main()
