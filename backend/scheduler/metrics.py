"""What a simulation reports, computed from finished jobs and the simulator's counters.

Definitions (docs/scheduling.md repeats them):

- JCT = completion - submission. Queueing delay = first start - submission.
- makespan = last completion - first submission.
- allocated utilisation = device-seconds held by jobs / (devices x makespan); useful
  utilisation counts only device-seconds that made progress (held minus overhead stalls).
- window utilisation = device-seconds held between the first and the last submission /
  (devices x that window): how busy the cluster was while work kept arriving.
- overhead device-hours = device-seconds held while stalled in a preemption, migration or
  resize, / 3600.
- tier guarantee = sum over the tier's jobs of W x duration / sum of W x JCT: the fraction of
  the device-time the tier's jobs asked for (W devices for as long as they were in the system)
  that they actually received as progress. 1.0 means never queued, shrunk or stalled.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

SIZE_BUCKETS = (("1", 1, 1), ("2-4", 2, 4), ("5-8", 5, 8), (">8", 9, 1 << 30))


@dataclass(frozen=True)
class Finished:
    """One completed job as metrics need it."""

    gpus: int
    sla: str
    submit: float
    start: float
    finish: float
    duration: float


def _stats(x: Sequence[float]) -> dict[str, float]:
    if len(x) == 0:
        nan = float("nan")
        return {"n": 0, "mean": nan, "median": nan, "p95": nan, "p99": nan, "max": nan}
    a = np.asarray(x, dtype=float)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"n": int(len(a)), "mean": float(a.mean()), "median": float(p50), "p95": float(p95), "p99": float(p99),
            "max": float(a.max())}


@dataclass
class SimReport:
    policy: str
    gpus: int
    gpus_per_node: int
    overhead_s: float
    seed: int
    jobs: int
    rejected: int
    jct: dict[str, float]
    jct_by_size: dict[str, dict[str, float]]
    queueing: dict[str, float]
    makespan_s: float
    util_allocated: float
    util_useful: float
    util_window: float
    preemptions: int
    migrations: int
    resizes: int
    overhead_gpu_hours: float
    guarantee: dict[str, float]
    rounds: int
    wall_s: float
    policy_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    finished: Sequence[Finished],
    *,
    policy: str,
    gpus: int,
    gpus_per_node: int,
    overhead_s: float,
    seed: int,
    rejected: int,
    allocated_ds: float,
    overhead_ds: float,
    util_window: float,
    counts: dict[str, int],
    rounds: int,
    wall_s: float,
    policy_s: float,
) -> SimReport:
    jct = [f.finish - f.submit for f in finished]
    by_size = {
        name: _stats([f.finish - f.submit for f in finished if lo <= f.gpus <= hi]) for name, lo, hi in SIZE_BUCKETS
    }
    if finished:
        makespan = max(f.finish for f in finished) - min(f.submit for f in finished)
    else:
        makespan = 0.0
    denom = gpus * makespan if makespan > 0 else float("nan")
    guarantee: dict[str, float] = {}
    for tier in ("premium", "standard", "basic"):
        mine = [f for f in finished if f.sla == tier]
        asked = sum(f.gpus * (f.finish - f.submit) for f in mine)
        got = sum(f.gpus * f.duration for f in mine)
        guarantee[tier] = got / asked if asked > 0 else float("nan")
    return SimReport(
        policy=policy,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        overhead_s=overhead_s,
        seed=seed,
        jobs=len(finished),
        rejected=rejected,
        jct=_stats(jct),
        jct_by_size=by_size,
        queueing=_stats([f.start - f.submit for f in finished]),
        makespan_s=makespan,
        util_allocated=allocated_ds / denom,
        util_useful=(allocated_ds - overhead_ds) / denom,
        util_window=util_window,
        preemptions=counts.get("preempt", 0),
        migrations=counts.get("migrate", 0),
        resizes=counts.get("resize", 0),
        overhead_gpu_hours=overhead_ds / 3600.0,
        guarantee=guarantee,
        rounds=rounds,
        wall_s=wall_s,
        policy_s=policy_s,
    )


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def format_report(r: SimReport) -> str:
    """A readable table of one simulation (times in hours)."""
    lines = [
        f"policy {r.policy}: {r.jobs} jobs on {r.gpus} GPUs ({r.gpus_per_node}/node), "
        f"overhead {r.overhead_s:g} s per move, seed {r.seed}"
        + (f", {r.rejected} jobs larger than the cluster left out" if r.rejected else ""),
        "",
        f"{'JCT (h)':<16}{'n':>7}{'mean':>10}{'median':>10}{'p95':>10}{'p99':>10}",
    ]
    rows = [("all", r.jct)] + [(f"{k} GPUs", v) for k, v in r.jct_by_size.items()] + [("queueing delay", r.queueing)]
    for name, s in rows:
        lines.append(f"{name:<16}{s['n']:>7}{_h(s['mean']):>10}{_h(s['median']):>10}{_h(s['p95']):>10}{_h(s['p99']):>10}")
    lines += [
        "",
        f"makespan {_h(r.makespan_s)} h; GPU utilisation {r.util_allocated:.1%} allocated, {r.util_useful:.1%} useful"
        f" ({r.util_window:.1%} allocated while jobs were arriving)",
        f"preemptions {r.preemptions}, migrations {r.migrations}, resizes {r.resizes}; "
        f"{r.overhead_gpu_hours:.1f} GPU-hours lost to overhead",
        "tier guarantee (progress received / device-time asked while in system): "
        + ", ".join(f"{k} {v:.1%}" for k, v in r.guarantee.items()),
        f"{r.rounds} scheduling rounds; simulated in {r.wall_s:.1f} s wall ({r.policy_s:.1f} s in the policy)",
    ]
    return "\n".join(lines)
