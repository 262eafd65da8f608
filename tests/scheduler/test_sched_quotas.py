"""Per-user tier quotas: premium beyond its user's quota runs as standard (standard as basic)."""
from __future__ import annotations

from backend.scheduler.quotas import over_quota
from backend.scheduler.singularity import singularity_policy
from backend.scheduler.types import Place, Preempt, Resize
from sched_helpers import B, P, S, apply, by_job, ndev, running, snapshot, waiting

NOW = 100_000.0
HOUR = 3600.0


def test_running_jobs_count_first_then_waiting_oldest_first():
    jobs = (
        waiting("w-old", P, 2, user="a", submitted_at=NOW - 50),
        waiting("w-new", P, 2, user="a", submitted_at=NOW - 10),
        running("r", P, 4, {"node-0": (0, 1, 2, 3)}, user="a", submitted_at=NOW - 5),
        waiting("other", P, 8, user="b", submitted_at=NOW - 60),
        waiting("std", S, 8, user="a", submitted_at=NOW - 60),
    )
    # a holds 4 running; 2 more fit in a quota of 6; b and a's standard work have no quota
    assert over_quota(jobs, {("a", "premium"): 6}) == {"w-new": S}
    assert over_quota(jobs, {("a", "premium"): 3}) == {"r": S, "w-new": S}  # w-old fits alone
    assert over_quota(jobs, {("a", "standard"): 0}) == {"std": B}
    assert over_quota(jobs, {}) == {}


def test_premium_over_quota_waits_as_standard_and_takes_nothing_standard_may_not():
    std = running("s", S, 8, {"node-0": tuple(range(8))}, user="a", submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [std, waiting("p", P, 4, user="a", submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    assert isinstance(acts["s"], Resize) and isinstance(acts["p"], Place)  # within quota: premium
    limited = snapshot(NOW, {"node-0": 8}, [std, waiting("p", P, 4, user="a", submitted_at=NOW)])
    limited = type(limited)(now=limited.now, nodes=limited.nodes, jobs=limited.jobs, quotas={("a", "premium"): 2})
    # over quota it is standard work: it may not shrink a standard job of its own user
    assert singularity_policy(limited) == []
    free = snapshot(NOW, {"node-0": 8}, [waiting("p", P, 4, user="a", submitted_at=NOW)])
    free = type(free)(now=free.now, nodes=free.nodes, jobs=free.jobs, quotas={("a", "premium"): 2})
    (place,) = singularity_policy(free)
    assert "premium over its user's premium quota, runs as standard job" in place.reason


def test_a_running_premium_job_over_quota_can_be_taken_from():
    prem = running("p-old", P, 8, {"node-0": tuple(range(8))}, user="a", submitted_at=NOW - 2 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [prem, waiting("p-b", P, 4, user="b", submitted_at=NOW)])
    assert singularity_policy(snap) == []  # premium is never touched
    snap = type(snap)(now=snap.now, nodes=snap.nodes, jobs=snap.jobs, quotas={("a", "premium"): 4})
    actions = singularity_policy(snap)
    after = apply(snap, actions)
    acts = by_job(actions)
    assert isinstance(acts["p-old"], Resize) and ndev(after["p-old"]) == 4 and ndev(after["p-b"]) == 4
    assert not any(isinstance(a, Preempt) for a in actions)
    assert "shrunk 8->4" in acts["p-old"].reason
