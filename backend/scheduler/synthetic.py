"""Synthetic cluster snapshots for load tests of a policy round (tests and bench share it).

The mix follows the Philly week: mostly 1-device jobs, some 2/4/8, a few 16; tiers 20/50/30.
Jobs are laid out oldest first until the cluster is nearly full (some standard and basic jobs
run shrunk, some were moved recently), and the rest wait, a fifth of them preempted. Running
and preempted jobs have had service (``ran_s``, ``attained_s``, drawn from a second generator so
that the layout does not depend on it), so service classes and same-tier LAS takes are
exercised. That is the expensive case for the policy: a long queue in front of a full cluster,
with premium work waiting that must take devices back.
"""
from __future__ import annotations

import numpy as np

from singularity_sdk.protocol import SLA, JobState

from .placement import FreeDevices, divisors
from .types import JobView, NodeView, Snapshot

SIZES = (1, 2, 4, 8, 16)
SIZE_P = (0.89, 0.01, 0.05, 0.045, 0.005)
TIERS = (SLA.PREMIUM, SLA.STANDARD, SLA.BASIC)
TIER_P = (0.2, 0.5, 0.3)


def big_snapshot(n_jobs: int = 10_000, n_nodes: int = 1_000, per_node: int = 8, seed: int = 0, fill: float = 0.97) -> Snapshot:
    """A full cluster with a long queue; deterministic for a seed."""
    rng = np.random.default_rng(seed)
    service = np.random.default_rng(seed + 1_000_003)
    now = 1_000_000.0
    names = [f"node-{i}" for i in range(n_nodes)]
    used: dict[str, dict[int, str]] = {n: {} for n in names}
    free = FreeDevices(NodeView(n, tuple(range(per_node))) for n in names)
    sizes = rng.choice(SIZES, size=n_jobs, p=SIZE_P)
    tiers = rng.choice(len(TIERS), size=n_jobs, p=TIER_P)
    users = rng.integers(0, 20, size=n_jobs)
    submitted = np.sort(now - rng.uniform(0, 86_400, size=n_jobs))
    target = int(fill * n_nodes * per_node)
    jobs: list[JobView] = []
    allocated = 0
    for i in range(n_jobs):
        w = int(sizes[i])
        sla = TIERS[int(tiers[i])]
        common = dict(id=f"j-{i:05d}", user=f"u{int(users[i])}", sla=sla, gpus=w, submitted_at=float(submitted[i]))
        p = w
        if sla != SLA.PREMIUM and w > 1 and rng.random() < 0.3:
            p = divisors(w)[1]
        placement = free.pick(p) if allocated + p <= target else None
        age = now - float(submitted[i])
        if placement is None:
            state = JobState.PREEMPTED if rng.random() < 0.2 else JobState.QUEUED
            ran = float(service.uniform(0, age)) if state == JobState.PREEMPTED else 0.0
            jobs.append(JobView(state=state, ran_s=ran, attained_s=ran * w, **common))
            continue
        free.take_placement(placement)
        for node, devs in placement.items():
            for d in devs:
                used[node][d] = common["id"]
        allocated += p
        moved = now - float(rng.uniform(0, 300)) if rng.random() < 0.1 else None
        ckpt = now - float(rng.uniform(0, 3_600))
        ran = float(service.uniform(0, age))
        jobs.append(
            JobView(
                state=JobState.RUNNING,
                placement=placement,
                last_checkpoint_at=ckpt,
                last_moved_at=moved,
                ran_s=ran,
                attained_s=ran * p,
                **common,
            )
        )
    nodes = tuple(NodeView(n, tuple(range(per_node)), used=used[n]) for n in names)
    return Snapshot(now=now, nodes=nodes, jobs=tuple(jobs))
