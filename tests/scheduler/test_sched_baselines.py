"""Baseline policies on hand-made snapshots."""
from __future__ import annotations

from backend.scheduler.baselines import PremiumFirstSRTFPolicy, SRTFPolicy, TiresiasPolicy, fifo_backfill_policy, fifo_gang_policy
from backend.scheduler.types import Place, Preempt
from sched_helpers import P, S, apply, by_job, ndev, running, snapshot, waiting
from singularity_sdk.protocol import JobState

NOW = 10_000.0


def _full_node(prefix: str = "r", k: int = 6) -> list:
    return [running(f"{prefix}-{i}", S, 1, {"node-0": (i,)}, submitted_at=0.0) for i in range(k)]


def test_fifo_gang_is_strict_and_keeps_gangs_on_one_node():
    jobs = _full_node() + [
        waiting("head", S, 4, submitted_at=1.0),
        waiting("small", S, 1, submitted_at=2.0),
    ]
    snap = snapshot(NOW, {"node-0": 8, "node-1": 2}, jobs)
    assert fifo_gang_policy(snap) == []  # 4 free devices in all, but no node has 4: head blocks
    snap = snapshot(NOW, {"node-0": 8, "node-1": 4}, jobs)
    acts = fifo_gang_policy(snap)
    assert [a.job_id for a in acts] == ["head", "small"]
    assert acts[0].placement == {"node-1": (0, 1, 2, 3)}


def test_fifo_backfill_lets_later_jobs_past_a_blocked_head():
    jobs = _full_node() + [waiting("head", S, 4, submitted_at=1.0), waiting("small", S, 1, submitted_at=2.0)]
    snap = snapshot(NOW, {"node-0": 8, "node-1": 2}, jobs)
    acts = fifo_backfill_policy(snap)
    assert [a.job_id for a in acts] == ["small"] and "backfilled" in acts[0].reason
    # preempted jobs are waiting too, in submit order
    jobs = _full_node(k=7) + [waiting("pre", S, 1, submitted_at=0.5, state=JobState.PREEMPTED)]
    assert [a.job_id for a in fifo_backfill_policy(snapshot(NOW, {"node-0": 8}, jobs))] == ["pre"]


def test_tiresias_preempts_by_attained_service_queue():
    attained = {"old": 50 * 3600.0, "mid": 2 * 3600.0, "new": 0.0}
    pol = TiresiasPolicy(attained.__getitem__, thresholds_gpu_s=(3600.0, 36000.0))
    old = running("old", S, 8, {"node-0": tuple(range(8))}, submitted_at=0.0)
    snap = snapshot(NOW, {"node-0": 8}, [old, waiting("new", S, 4, submitted_at=NOW)])
    actions = pol(snap)
    acts = by_job(actions)
    assert isinstance(acts["old"], Preempt) and isinstance(acts["new"], Place)
    assert "queue 2" in acts["old"].reason and "new" in acts["old"].reason
    assert isinstance(actions[0], Preempt)  # frees before it places
    apply(snap, actions)
    # same queue: FIFO inside a queue, no preemption
    mid = running("mid", S, 8, {"node-0": tuple(range(8))}, submitted_at=0.0)
    attained["new"] = 1.5 * 3600.0
    assert pol(snapshot(NOW, {"node-0": 8}, [mid, waiting("new", S, 4, submitted_at=NOW)])) == []


def test_preemptive_baselines_preempt_only_jobs_whose_devices_are_needed():
    remaining = {"a": 1000.0, "b": 900.0, "c": 10.0}
    pol = SRTFPolicy(remaining.__getitem__)
    a = running("a", S, 4, {"node-0": (0, 1, 2, 3)}, submitted_at=0.0)
    b = running("b", S, 4, {"node-1": (0, 1, 2, 3)}, submitted_at=0.0)
    snap = snapshot(NOW, {"node-0": 4, "node-1": 4}, [a, b, waiting("c", S, 4, submitted_at=NOW)])
    actions = pol(snap)
    after = apply(snap, actions)
    # both a and b rank below c, but only one node is needed: the lower-ranked a is the loser
    assert [type(x).__name__ for x in actions] == ["Preempt", "Place"]
    assert actions[0].job_id == "a" and ndev(after["c"]) == 4 and after["b"]


def test_preemptive_baselines_backfill_idle_devices():
    remaining = {"big": 10.0, "small": 1000.0}
    pol = SRTFPolicy(remaining.__getitem__)
    blocker = running("x", S, 2, {"node-0": (0, 1)}, submitted_at=0.0)
    remaining["x"] = 5.0
    snap = snapshot(NOW, {"node-0": 4}, [blocker, waiting("big", S, 4), waiting("small", S, 1)])
    acts = pol(snap)
    # big is admitted by count (2 + 4 > 4 so it is not), small fits and starts
    assert [a.job_id for a in acts] == ["small"]


def test_premium_first_srtf_never_takes_from_premium_for_shorter_other_work():
    remaining = {"prem": 9000.0, "std": 5000.0, "short": 10.0}
    prem = running("prem", P, 4, {"node-0": (0, 1, 2, 3)}, submitted_at=0.0)
    std = running("std", S, 4, {"node-1": (0, 1, 2, 3)}, submitted_at=0.0)
    snap = snapshot(NOW, {"node-0": 4, "node-1": 4}, [prem, std, waiting("short", S, 4, submitted_at=NOW)])
    # plain SRTF takes from the longest job, premium or not ...
    assert [(type(a).__name__, a.job_id) for a in SRTFPolicy(remaining.__getitem__)(snap)] == [
        ("Preempt", "prem"), ("Place", "short")]
    # ... the premium-first oracle takes from the standard job, and a waiting premium job goes
    # before shorter standard work
    acts = PremiumFirstSRTFPolicy(remaining.__getitem__)(snap)
    assert [(type(a).__name__, a.job_id) for a in acts] == [("Preempt", "std"), ("Place", "short")]
    assert acts[0].reason.endswith("(remaining 1.39 h at full size)")
    remaining["late"] = 20000.0  # longer than everything: premium goes first all the same
    snap = snapshot(NOW, {"node-0": 4, "node-1": 4},
                    [prem, std, waiting("short", S, 4, submitted_at=NOW), waiting("late", P, 4, submitted_at=NOW)])
    acts = by_job(PremiumFirstSRTFPolicy(remaining.__getitem__)(snap))
    assert isinstance(acts["std"], Preempt) and isinstance(acts["late"], Place) and "short" not in acts
    # a running premium job is never preempted, not even for a waiting premium job
    remaining["early"] = 1.0
    snap = snapshot(NOW, {"node-0": 4}, [prem, waiting("early", P, 4, submitted_at=-1.0)])
    assert PremiumFirstSRTFPolicy(remaining.__getitem__)(snap) == []
