"""Resize latency and replica-splicing efficiency of a data-parallel job, through the real
server, agent and worker path (``job.resize``), on one ``LocalCluster(nodes=1, devices_per_node=4)``.

    python bench/resize.py [--mb 10 100] [--repeats 3] [--splice-mb 4] [--splice-batch 1024]
                           [--seconds 6] [--rounds 3] [--no-pin] [--no-turns-control]
                           [--skip-resize] [--skip-splice]

The job is an ordinary DDP script (an MLP of ``--layers`` square Linear layers and Adam; nothing
in it knows about the proxy). Rank 0 prints one line per training step with ``time.time()``, so
step times come from the job's own clock, not from when its output reached the SDK.

1. Resize latency. A W = 4 job whose parameters + Adam state (3 x the parameters) are ``--mb`` MB
   is resized 4 -> 2 -> 1 -> 4, ``--repeats`` times. The ``resized`` event gives the server's split,
   between these marks: the request, the first ``checkpoint_started``, the first ``checkpointed``
   (rank 0 reports it once the manifest of all W ranks is committed), the ``started`` of the new
   attempt, and rank 0's ``resumed``:

     barrier     request -> checkpoint_started (server -> agent -> worker, the next safe point)
     checkpoint  -> checkpointed (every rank writes its part; deduplicated blobs; the commit)
     restart     -> started (ranks exit 75, the server settles and places, the agent spawns ranks)
     restore     -> resumed (the new ranks: start, rendezvous, load the checkpoint, walk back in)

   plus ``first step``, from ``resumed`` to the first step line the new ranks print (the first
   DDP iteration after the restore), and ``total``, from the request to that line. The table gives
   medians per transition. The checkpoint's size is the ``checkpointed`` event's ``bytes`` (all
   ranks' files and blobs).

2. Splicing efficiency. A W = 4 job is resized through P = 4, 2, 1 devices (S = W/P ranks take turns
   on each device) and back through 1, 2, 4 (a palindrome, so linear drift hits every P alike),
   ``--rounds`` times. A W = 2 job does the same with P = 2, 1, 1, 2. A W = 1 job of the same model
   gives the compute-only step (no exchange, one core), and, as a control, a W = 4 job on P = 2, 1
   runs with ``SINGULARITY_TURNS=0`` (the OS time-slices the ranks of a slot instead of turns).
   In each window the first ``--warmup`` steps after a (re)start are dropped and the steady state
   is timed for ``--seconds``: throughput = steps / wall time, from rank 0's printed timestamps.
   Ideal = base throughput x S_base / S, overhead = ideal / measured - 1 (the extra time per step
   beyond the ideal; negative = faster than ideal), against two bases: P = W (S = 1, the paper's
   definition) and the largest P whose slots each have a core of their own. The CPU the rest of the
   machine used during each window (other sessions' tests) is printed beside it.

CPU "devices": the agent starts every rank with one thread pinned to its slot's cores (on a
2-core machine with 4 slots: core ``slot mod 2``). The job also pins every thread of each rank
to core ``slot mod cores`` (its slot from ``SINGULARITY_PLACEMENT``), the same choice, kept from
before the agent pinned; ``--no-pin`` turns both off (``SINGULARITY_PIN_CPU_SLOTS=0`` for the
agent) to show what unpinned slots do. P = 4 on 2 cores is 2 slots per core, oversubscribed, and
flagged so in the table.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import Collector, fmt_s, print_table  # noqa: E402

from singularity_sdk import EventType, LocalCluster  # noqa: E402

# The job. Pinning runs inside the loop because a restored rank does not re-run the statements
# before it (the namespace comes back from the checkpoint); ``taskset -a`` pins every thread the
# process has by then (gloo's, the collective worker's), once per process. It must not be a Python
# loop over the threads: their number differs between ranks, and a loop whose trip count differs
# between ranks desynchronises the ranks' safe-point counters, so their parts of a checkpoint go
# to different folders and it never commits (see docs/benchmarks.md, "Resize latency").
JOB = '''\
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
width, layers, batch = int(os.environ["BENCH_WIDTH"]), int(os.environ["BENCH_LAYERS"]), int(os.environ["BENCH_BATCH"])
torch.manual_seed(0)
blocks = []
for _ in range(layers):
    blocks += [nn.Linear(width, width), nn.Tanh()]
ddp = DDP(nn.Sequential(*blocks))
opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
for step in range(10_000_000):
    if os.environ.get("BENCH_PIN") == "1" and os.environ.get("BENCH_PINNED") != str(os.getpid()):
        slots = os.environ.get("SINGULARITY_PLACEMENT", str(rank)).split("|")
        slot = [i for i, s in enumerate(slots) if str(rank) in s.split(",")][0]
        core = sorted(os.sched_getaffinity(0))[slot % len(os.sched_getaffinity(0))]
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(os.getpid())],
                       stdout=subprocess.DEVNULL, check=True)
        os.environ["BENCH_PINNED"] = str(os.getpid())
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} t {time.time():.6f}", flush=True)
'''

MB = 1_000_000


def model_env(mb: float, layers: int, batch: int, pin: bool) -> dict[str, str]:
    """Width such that parameters + Adam's two moments (3 x 4 bytes per parameter) make ``mb`` MB."""
    params = mb * MB / 12
    width = max(8, round(math.sqrt(params / layers)))
    return {"BENCH_WIDTH": str(width), "BENCH_LAYERS": str(layers), "BENCH_BATCH": str(batch),
            "BENCH_PIN": "1" if pin else "0"}


def step_times(ev: Any) -> list[tuple[int, float]]:
    """(step, printed wall time) of each step line ``step N t T`` the event carries."""
    if ev.data.get("stream") != "stdout":
        return []
    parts = [line.split() for line in ev.lines if line.startswith("step ")]
    return [(int(p[1]), float(p[3])) for p in parts]


def scan(c: Collector, after: int, fn: Callable[[Any], bool], timeout: float = 300) -> Any:
    """Call ``fn`` once per event after ``after``, in order, until it returns True (``Collector.wait``
    re-runs its predicate over every event on each wake-up, so it cannot count)."""
    deadline = time.monotonic() + timeout
    i = 0
    with c.cond:
        while True:
            while i < len(c.events):
                ev = c.events[i]
                i += 1
                if ev.seq > after and fn(ev):
                    return ev
            if c.error is not None:
                raise RuntimeError(f"event stream failed: {c.error!r}")
            if not c.thread.is_alive():
                raise RuntimeError(f"job {c.job.id} ended early; last: {[e.type.value for e in c.events[-8:]]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {c.job.id}: waited {timeout}s; last: {[e.type.value for e in c.events[-8:]]}")
            c.cond.wait(left)


def steps_after(c: Collector, seq: int, count: int, timeout: float = 300) -> None:
    """Wait until the job printed ``count`` step lines after event ``seq``."""
    seen = [0]

    def fn(ev: Any) -> bool:
        seen[0] += len(step_times(ev))
        return seen[0] >= count

    scan(c, seq, fn, timeout)


def steady_window(c: Collector, seq: int, warmup: int, seconds: float, meter: Optional["CpuMeter"] = None,
                  timeout: float = 300) -> list[float]:
    """Printed times of the step lines after ``seq``, dropping ``warmup``, spanning ``seconds``
    (``meter`` starts counting CPU at the window's first step)."""
    times: list[float] = []
    skipped = [0]

    def fn(ev: Any) -> bool:
        for _step, t in step_times(ev):
            if skipped[0] < warmup:
                skipped[0] += 1
                continue
            times.append(t)
            if meter is not None and len(times) == 1:
                meter.begin()
        return len(times) >= 5 and times[-1] - times[0] >= seconds

    scan(c, seq, fn, timeout)
    return times


def only_our_resizes(job: Any, expected: int) -> list[Any]:
    """The job's events, after checking that the scheduler did not resize it on its own (a user's
    resize sets what the job asks for, so it should not; a move of its own would skew a window)."""
    events = list(job.events(follow=False))
    moves = [e for e in events if e.type in (EventType.RESIZED, EventType.MIGRATED, EventType.PREEMPTED)]
    if len(moves) != expected or any(e.type != EventType.RESIZED for e in moves):
        got = [(e.type.value, e.data) for e in moves]
        raise SystemExit(f"job {job.id}: expected {expected} resizes of ours, got {got}")
    return events


def cancel(job: Any) -> None:
    try:
        job.cancel()
        job.wait(60)
    except Exception:  # noqa: BLE001 - already ended
        pass


# --------------------------------------------------------------------------- 1. resize latency
def resize_latency(client: Any, mb: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Resize a W = 4 job of ``mb`` MB of state 4 -> 2 -> 1 -> 4, ``repeats`` times."""
    env = model_env(mb, args.layers, args.batch, pin=False)  # no taskset in the first new step
    job = client.submit(JOB, gpus=4, env=env, name=f"resize-{mb:g}MB", filename="ddp_bench.py")
    c = Collector(job)
    try:
        steps_after(c, 0, args.warmup, timeout=600)
        for rep in range(args.repeats):
            for to in (2, 1, 4):
                since = c.last_seq
                job.resize(to, timeout=600)
                done = c.first(EventType.RESIZED, since)
                steps_after(c, done.seq, args.steps_between)
                d = done.data
                print(f"  {mb:g} MB #{rep + 1} {d['from']} -> {d['to']} (S={d['splicing']}): "
                      f"{d['seconds']:.3f} s {d.get('phases')}", flush=True)
    finally:
        cancel(job)
    events = only_our_resizes(job, 3 * args.repeats)
    return [transition(events, i, ev) for i, ev in enumerate(events) if ev.type == EventType.RESIZED]


def transition(events: list[Any], index: int, resized: Any) -> dict[str, Any]:
    """One resize's phases, checkpoint and first new step, from the job's full event log; and the
    job's steady step time before the request (old size) and after the first new step (new size)."""
    request = next(e for e in reversed(events[:index]) if e.type == EventType.RESIZING)
    later = [e for e in events if e.seq > request.seq]
    ckpt = next(e for e in later if e.type == EventType.CHECKPOINTED)
    started = next(e for e in later if e.type == EventType.STARTED)
    req_t = float(request.data.get("requested_at", request.time))
    nxt = next((e for e in later if e.type == EventType.RESIZING), None)
    end_t = float(nxt.data.get("requested_at", nxt.time)) if nxt else math.inf
    stamps = [t for e in events for _step, t in step_times(e)]
    first_t = next(t for t in stamps if t > started.time)
    before = [t for t in stamps if t < req_t][-6:]
    after = [t for t in stamps if first_t <= t < end_t][:7]

    def interval(ts: list[float]) -> float:
        return statistics.median(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 1 else math.nan

    d = resized.data
    return {"from": d["from"], "to": d["to"], "S": d["splicing"], "seconds": float(d["seconds"]),
            **{k: float(v) for k, v in (d.get("phases") or {}).items()},
            "first_step": first_t - resized.time, "total": first_t - req_t,
            "old_step": interval(before), "new_step": interval(after),
            "bytes": int(ckpt.data.get("bytes", 0)), "write_s": float(ckpt.data.get("seconds", 0))}


def report_latency(results: list[tuple[float, list[dict[str, Any]]]]) -> None:
    head = [("MB", 4), ("transition", 10), ("S", 2), ("n", 2), ("barrier", 7), ("checkpoint", 10),
            ("restart", 7), ("restore", 7), ("(resized)", 9), ("first step", 10), ("total", 6),
            ("total range", 11), ("step old/new", 12), ("ckpt bytes", 12), ("(rank-0 write)", 14)]
    rows = []
    for mb, trans in results:
        for frm, to in ((4, 2), (2, 1), (1, 4)):
            xs = [t for t in trans if (t["from"], t["to"]) == (frm, to)]
            if not xs:
                continue

            def m(key: str) -> str:
                vals = [t[key] for t in xs if key in t]
                return fmt_s(statistics.median(vals)) if vals else "-"

            totals = [t["total"] for t in xs]
            rows.append([f"{mb:g}", f"{frm} -> {to}", str(xs[0]["S"]), str(len(xs)), m("barrier"),
                         m("checkpoint"), m("restart"), m("restore"), m("seconds"), m("first_step"),
                         m("total"), f"{min(totals):.2f}-{max(totals):.2f}", f"{m('old_step')}/{m('new_step')}",
                         f"{int(statistics.median(t['bytes'] for t in xs)):,}", m("write_s")])
    print_table("resize latency of a W=4 DDP job, medians per transition, seconds (phases from the `resized` "
                "event, which ends at rank 0's `resumed`; first step = resumed -> first new step line; total = "
                "request -> that line; step old/new = the job's steady step time before / after)", head, rows)


# --------------------------------------------------------------------------- 2. splicing efficiency
class CpuMeter:
    """CPU used during a window, in cores: by the cluster's process tree (server, agent, ranks)
    and this script, and by everything else on the machine (other sessions' tests): the noise."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4]  # all but idle and iowait

    def _mine(self) -> float:
        children: dict[int, list[int]] = {}
        times: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
            times[int(entry)] = float(fields[11]) + float(fields[12])  # utime + stime
        total, todo = 0.0, [os.getpid()]  # the LocalCluster's server is our child
        while todo:
            pid = todo.pop()
            total += times.get(pid, 0.0)
            todo += children.get(pid, [])
        return total

    def begin(self) -> None:
        self.start = (time.monotonic(), self._busy(), self._mine())

    def end(self) -> dict[str, float]:
        t, busy, mine = time.monotonic(), self._busy(), self._mine()
        wall = (t - self.start[0]) * self.hz
        ours = mine - self.start[2]
        return {"ours": ours / wall, "others": max(0.0, (busy - self.start[1] - ours) / wall)}


def splice_run(client: Any, meter: CpuMeter, world: int, args: argparse.Namespace, turns: bool = True,
               sizes: Optional[list[int]] = None) -> list[dict[str, Any]]:
    """Steady-state throughput of one W-rank job resized through ``sizes`` (default P = W ... 1)
    and back, ``rounds`` times (a palindrome: linear drift hits every size alike)."""
    sizes = sizes or [p for p in (4, 2, 1) if p <= world and world % p == 0]
    order: list[int] = []
    for r in range(args.rounds):
        order += sizes if r % 2 == 0 else sizes[::-1]
    env = model_env(args.splice_mb, args.layers, args.splice_batch, args.pin)
    if not turns:
        env["SINGULARITY_TURNS"] = "0"
    job = client.submit(JOB, gpus=order[0], ranks=world, env=env, name=f"splice-W{world}", filename="ddp_bench.py")
    c = Collector(job)
    segments = []
    try:
        now, seq = order[0], 0
        for i, p in enumerate(order):
            warm = args.warmup
            if p != now:
                since = c.last_seq
                job.resize(p, timeout=600)
                seq = c.first(EventType.RESIZED, since).seq
                now = p
            elif i > 0:
                seq, warm = c.last_seq, 0  # same size as the previous window: just the next window
            times = steady_window(c, seq, warm, args.seconds, meter, timeout=600)
            cpu = meter.end()
            rate = (len(times) - 1) / (times[-1] - times[0])
            segments.append({"W": world, "P": p, "S": world // p, "turns": turns, "rate": rate,
                             "steps": len(times) - 1, **cpu})
            print(f"  W={world} P={p} S={world // p}{'' if turns else ' (no turns)'}: {rate:.2f} steps/s over "
                  f"{len(times) - 1} steps; CPU cores used: ours {cpu['ours']:.2f}, others {cpu['others']:.2f}",
                  flush=True)
    finally:
        cancel(job)
    only_our_resizes(job, sum(a != b for a, b in zip(order, order[1:])))
    return segments


def report_splice(segments: list[dict[str, Any]], cores: int, pin: bool, floor: Optional[float]) -> None:
    head = [("W", 2), ("P", 2), ("S", 2), ("slots on cores", 16), ("steps/s", 7), ("windows", 23),
            ("step ms", 7), ("floor ms", 8), ("floor/step", 10), ("ideal(S=1)", 10), ("ovh(S=1)", 8),
            ("ideal(fair)", 11), ("ovh(fair)", 9), ("others' CPU", 11)]
    rows = []
    for world, turns in sorted({(s["W"], s["turns"]) for s in segments}, key=lambda k: (-k[0], not k[1])):
        mine = [s for s in segments if s["W"] == world and s["turns"] == turns]
        ps = sorted({s["P"] for s in mine}, reverse=True)
        rate = {p: statistics.median(s["rate"] for s in mine if s["P"] == p) for p in ps}
        base_s1 = rate.get(world) if turns else None  # S = 1
        fair_p = max((p for p in ps if p <= cores), default=None)  # the most slots that each have a core
        for p in ps:
            s, r = world // p, rate[p]
            xs = [x for x in mine if x["P"] == p]
            if world == 1:
                where = "compute only"
            elif pin:
                where = f"{p} on {min(p, cores)}" + (f" ({p // cores}/core)" if p > cores else "")
            else:
                where = f"{p}, unpinned"
            where += "" if turns else ", no turns"
            step_floor = floor * world / min(p, cores) if floor else None  # compute only: W*c over the cores used
            ideal1 = base_s1 * 1 / s if base_s1 else None
            fair = rate[fair_p] * (world // fair_p) / s if fair_p else None
            rows.append([str(world), str(p), str(s), where, f"{r:.2f}", " ".join(f"{x['rate']:.2f}" for x in xs),
                         f"{1e3 / r:.1f}", f"{step_floor * 1e3:.1f}" if step_floor else "-",
                         f"{step_floor * r:.2f}" if step_floor else "-",
                         f"{ideal1:.2f}" if ideal1 else "-", f"{ideal1 / r - 1:+.1%}" if ideal1 else "-",
                         f"{fair:.2f}" if fair else "-", f"{fair / r - 1:+.1%}" if fair else "-",
                         f"{statistics.median(x['others'] for x in xs):.2f}"])
    print_table("splicing efficiency: steady-state steps/s of rank 0 (median of the windows, each listed); "
                "ideal = base rate x S_base / S; ovh = ideal / measured - 1 (target <= +3 %); (S=1): base P = W; "
                "(fair): base = the most slots that each have a core; floor = compute only (1-rank job's step x "
                "ranks per core used); others' CPU = cores busy outside this benchmark (median)", head, rows)
    spread = []
    for world, turns in sorted({(s["W"], s["turns"]) for s in segments}, key=lambda k: (-k[0], not k[1])):
        for p in sorted({s["P"] for s in segments if s["W"] == world and s["turns"] == turns}, reverse=True):
            xs = [s["rate"] for s in segments if s["W"] == world and s["P"] == p and s["turns"] == turns]
            if len(xs) > 1:
                spread.append(f"W={world} P={p}{'' if turns else ' no turns'} {max(xs) / min(xs) - 1:.1%}")
    if spread:
        print("spread of the same configuration's windows (max/min - 1): " + ", ".join(spread))
    how = f"each rank on core (slot mod {cores})" if pin else "none (agent pinning off too)"
    print(f"pinning: {how}\n")


def compute_floor(client: Any, meter: CpuMeter, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seconds per step of the same model as a 1-rank job alone on one core: compute, no exchange."""
    segs = splice_run(client, meter, 1, argparse.Namespace(**{**vars(args), "rounds": 2}), sizes=[1])
    return segs


# --------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, nargs="+", default=[10, 100],
                   help="resize table: MB of parameters + Adam state (3 x the parameters)")
    p.add_argument("--repeats", type=int, default=3, help="resize table: cycles 4 -> 2 -> 1 -> 4 per size")
    p.add_argument("--steps-between", type=int, default=6,
                   help="resize table: new steps printed before the next resize")
    p.add_argument("--layers", type=int, default=4, help="square Linear layers of the MLP")
    p.add_argument("--batch", type=int, default=16, help="resize table: rows per step")
    p.add_argument("--splice-mb", type=float, default=4, help="splicing table: MB of parameters + Adam state")
    p.add_argument("--splice-batch", type=int, default=1024,
                   help="splicing table: rows per step (large: compute should dominate the step)")
    p.add_argument("--seconds", type=float, default=6.0, help="splicing table: steady-state window per segment")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped after a (re)start")
    p.add_argument("--rounds", type=int, default=3, help="splicing table: passes over the sizes (alternating order)")
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="splicing table: world sizes")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="splicing table: pin each rank's threads to core (slot mod cores): a CPU slot = one core")
    p.add_argument("--turns-control", action=argparse.BooleanOptionalAction, default=True,
                   help="splicing table: also W=4 on P=2, 1 with SINGULARITY_TURNS=0 (the OS time-slices the slot)")
    p.add_argument("--skip-resize", action="store_true")
    p.add_argument("--skip-splice", action="store_true")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    latency: list[tuple[float, list[dict[str, Any]]]] = []
    segments: list[dict[str, Any]] = []
    agent_env = {} if args.pin else {"SINGULARITY_PIN_CPU_SLOTS": "0"}
    with LocalCluster(nodes=1, devices_per_node=4, env=agent_env) as cluster, cluster.client() as client:
        meter = CpuMeter()
        if not args.skip_resize:
            for mb in args.mb:
                latency.append((mb, resize_latency(client, mb, args)))
        if not args.skip_splice:
            segments += compute_floor(client, meter, args)
            for world in args.worlds:
                segments += splice_run(client, meter, world, args)
            if args.turns_control and 4 in args.worlds:
                segments += splice_run(client, meter, 4, args, turns=False, sizes=[2, 1])
    print()
    if latency:
        report_latency(latency)
    if segments:
        ones = [x["rate"] for x in segments if x["W"] == 1]
        report_splice(segments, cores, args.pin, 1 / statistics.median(ones) if ones else None)
    print(f"({time.monotonic() - t0:.0f} s in all; {cores} cores; load average {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end)")


if __name__ == "__main__":
    main()
