"""Job traces for the simulator: read ``submit_s,duration_s,num_gpus,vc`` and assign tiers.

Tiers are not in the Philly data; they are drawn reproducibly from a seeded generator
(20 % premium, 50 % standard, 30 % basic), one draw per job in trace order, so the same seed
gives every policy the same tiers. The user of a job is its virtual cluster (``vc``): fair
share between users is fair share between teams.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from singularity_sdk.protocol import SLA

TIER_MIX = ((SLA.PREMIUM, 0.2), (SLA.STANDARD, 0.5), (SLA.BASIC, 0.3))


@dataclass(frozen=True)
class TraceJob:
    id: str
    submit: float
    duration: float  # run time at the requested size, seconds
    gpus: int
    user: str
    sla: SLA


def assign_tiers(n: int, seed: int, mix: Sequence[tuple[SLA, float]] = TIER_MIX) -> list[SLA]:
    """One tier per job, drawn from ``mix`` with a seeded generator (reproducible)."""
    u = np.random.default_rng(seed).random(n)
    edges = np.cumsum([w for _, w in mix])
    edges[-1] = 1.0
    idx = np.searchsorted(edges, u, side="right")
    return [mix[int(i)][0] for i in idx]


def make_jobs(rows: Iterable[tuple[float, float, int, str]], seed: int = 0) -> list[TraceJob]:
    """Trace rows (submit, duration, gpus, user) -> jobs with ids and seeded tiers."""
    rows = list(rows)
    tiers = assign_tiers(len(rows), seed)
    width = max(4, len(str(len(rows))))
    return [
        TraceJob(f"j-{i:0{width}d}", float(s), float(d), int(g), str(u), tiers[i])
        for i, (s, d, g, u) in enumerate(rows)
    ]


def load_trace(path: str | Path, seed: int = 0, limit: int | None = None) -> list[TraceJob]:
    """Read a trace CSV (``submit_s,duration_s,num_gpus,vc``); ``limit`` keeps the first rows."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"submit_s", "duration_s", "num_gpus", "vc"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for r in reader:
            rows.append((float(r["submit_s"]), float(r["duration_s"]), int(r["num_gpus"]), r["vc"]))
            if limit is not None and len(rows) >= limit:
                break
    for s, d, g, _ in rows:
        if d <= 0 or g <= 0 or s < 0:
            raise ValueError(f"{path}: bad row submit={s} duration={d} gpus={g}")
    return make_jobs(rows, seed)
