"""Standard and basic work in one least-attained-service pool (``PolicyConfig.las_across``).

Each rule here fails under the per-tier policy it replaced (``las_across=False``), which the
tests run as the wrong policy to make sure they can tell the difference.
"""
from __future__ import annotations

from backend.scheduler.singularity import PolicyConfig, singularity_policy
from backend.scheduler.types import Place, Preempt, Resize
from sched_helpers import B, P, S, apply, by_job, ndev, running, snapshot, waiting
from singularity_sdk.protocol import JobState

NOW = 1_000_000.0
HOUR = 3600.0
POOL = PolicyConfig()
PER_TIER = PolicyConfig(las_across=False, basic_min_fraction=0.0)


def _full_node(sla, attained_h: float, n: int = 8):
    return [
        running(f"r-{i}", sla, 1, {"node-0": (i,)}, user="a", submitted_at=NOW - attained_h * HOUR - 600,
                ckpt=NOW - 900 + i,
                attained=attained_h * HOUR, ran=attained_h * HOUR)
        for i in range(n)
    ]


def test_a_new_basic_job_preempts_a_long_served_standard_job():
    snap = snapshot(NOW, {"node-0": 8}, _full_node(S, 12.0) + [waiting("b-new", B, 1, submitted_at=NOW - 60)])
    actions = singularity_policy(snap, POOL)
    apply(snap, actions)
    acts = by_job(actions)
    # the one that loses least work (newest checkpoint) goes
    assert set(acts) == {"r-7", "b-new"} and isinstance(acts["r-7"], Preempt)
    assert "12.00 device-hours" in acts["r-7"].reason
    assert singularity_policy(snap, PER_TIER) == []


def test_no_take_without_a_large_service_gap():
    # 0.5 device-hours is one class above a new job: not enough (las_take_gap = 2)
    snap = snapshot(NOW, {"node-0": 8}, _full_node(S, 0.5) + [waiting("b-new", B, 1, submitted_at=NOW - 60)])
    assert singularity_policy(snap, POOL) == []
    # and a job that has had service itself takes only from jobs two classes above it
    served = waiting("s-old", S, 1, submitted_at=NOW - 5 * HOUR, state=JobState.PREEMPTED,
                     attained=2 * HOUR, ran=2 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, _full_node(B, 5.0) + [served])
    # basic work is taken by standard work whatever its service (lower tier)...
    assert set(by_job(singularity_policy(snap, POOL))) == {"r-7", "s-old"}
    snap = snapshot(NOW, {"node-0": 8}, _full_node(S, 5.0) + [served])
    # ...standard work only by far less service: 2 h is class 2, 5 h class 2 as well
    assert singularity_policy(snap, POOL) == []


def test_a_spliceable_long_served_job_is_shrunk_before_anyone_is_preempted():
    jobs = [running("s-wide", S, 4, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - 20 * HOUR,
                    attained=40 * HOUR, ran=10 * HOUR)]
    jobs += [running(f"r-{i}", S, 1, {"node-0": (i,)}, submitted_at=NOW - 20 * HOUR, attained=12 * HOUR,
                     ran=12 * HOUR) for i in range(4, 8)]
    snap = snapshot(NOW, {"node-0": 8}, jobs + [waiting("new", B, 2, submitted_at=NOW - 60)])
    actions = singularity_policy(snap, POOL)
    after = apply(snap, actions)
    acts = by_job(actions)
    assert set(acts) == {"s-wide", "new"} and isinstance(acts["s-wide"], Resize)
    assert ndev(after["s-wide"]) == 2 and ndev(after["new"]) == 2


def test_pool_order_is_by_service_before_tier():
    # one free device: a new basic job goes before a standard job preempted after long runs
    blocker = running("x", P, 7, {"node-0": tuple(range(7))}, submitted_at=NOW - HOUR)
    old_std = waiting("s-old", S, 1, submitted_at=NOW - 30 * HOUR, state=JobState.PREEMPTED,
                      attained=20 * HOUR, ran=20 * HOUR)
    new_basic = waiting("b-new", B, 1, submitted_at=NOW - 60)
    snap = snapshot(NOW, {"node-0": 8}, [blocker, old_std, new_basic])
    assert set(by_job(singularity_policy(snap, POOL))) == {"b-new"}
    assert set(by_job(singularity_policy(snap, PER_TIER))) == {"s-old"}
    # within one service class, the standard job goes first
    new_std = waiting("s-new", S, 1, submitted_at=NOW - 30)
    snap = snapshot(NOW, {"node-0": 8}, [blocker, new_basic, new_std])
    assert set(by_job(singularity_policy(snap, POOL))) == {"s-new"}


def test_premium_stays_out_of_the_pool():
    prem = [running(f"p-{i}", P, 1, {"node-0": (i,)}, submitted_at=NOW - 30 * HOUR, attained=25 * HOUR,
                    ran=25 * HOUR) for i in range(8)]
    snap = snapshot(NOW, {"node-0": 8}, prem + [waiting("b-new", B, 1, submitted_at=NOW - 60),
                                                waiting("s-new", S, 1, submitted_at=NOW - 60)])
    assert singularity_policy(snap, POOL) == []
    assert all(not isinstance(a, Preempt) for a in singularity_policy(snap, POOL))


def test_basic_jobs_are_shrunk_to_half_at_most():
    wide = running("b-8", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - 2 * HOUR, ran=2 * HOUR,
                   attained=16 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [wide, waiting("p", P, 4, submitted_at=NOW)])
    after = apply(snap, singularity_policy(snap, POOL))
    assert ndev(after["b-8"]) == 4 and ndev(after["p"]) == 4
    snap = snapshot(NOW, {"node-0": 8}, [wide, waiting("p", P, 6, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap, POOL))
    assert isinstance(acts["b-8"], Preempt) and isinstance(acts["p"], Place)
    after = apply(snap, singularity_policy(snap, PER_TIER))
    assert ndev(after["b-8"]) == 2  # the per-tier rule squeezed it onto 2 of 8


def test_with_tier_take_min_class_standard_work_leaves_a_just_started_basic_job_alone():
    """With ``tier_take_min_class=1`` (measured, off by default) standard work takes basic jobs
    whatever their service, but not one that has just started (victim class 0), which is
    otherwise the first victim, having the newest checkpoint."""
    rule = PolicyConfig(tier_take_min_class=1)
    fresh = running("b-fresh", B, 1, {"node-0": (0,)}, submitted_at=NOW - 120, ckpt=NOW - 60,
                    attained=60.0, ran=60.0)
    served = [running(f"b-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - 2 * HOUR, ckpt=NOW - 1800,
                      attained=0.5 * HOUR, ran=0.5 * HOUR) for i in range(1, 8)]
    want = waiting("s-new", S, 1, submitted_at=NOW - 30)
    snap = snapshot(NOW, {"node-0": 8}, [fresh] + served + [want])
    acts = by_job(singularity_policy(snap, rule))
    apply(snap, list(acts.values()))
    assert "b-fresh" not in acts and isinstance(acts["s-new"], Place)
    assert sum(isinstance(a, Preempt) for a in acts.values()) == 1
    # the default (any basic job) takes the fresh one, its checkpoint being the newest
    wrong = by_job(singularity_policy(snap, POOL))
    assert isinstance(wrong["b-fresh"], Preempt)
    # with only just-started basic jobs on the node, standard work waits ...
    only_fresh = [running(f"f-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - 120, ckpt=NOW - 60,
                          attained=60.0, ran=60.0) for i in range(8)]
    snap = snapshot(NOW, {"node-0": 8}, only_fresh + [want])
    assert by_job(singularity_policy(snap, rule)) == {}
    assert isinstance(by_job(singularity_policy(snap, POOL))["s-new"], Place)
    # ... while premium work still takes one, and a basic job aged into standard too (no starvation)
    acts = by_job(singularity_policy(snapshot(NOW, {"node-0": 8}, only_fresh + [waiting("p", P, 1)]), rule))
    assert isinstance(acts["p"], Place)
    aged = waiting("b-aged", B, 1, submitted_at=NOW - 5 * HOUR, ran=0.0)
    acts = by_job(singularity_policy(snapshot(NOW, {"node-0": 8}, only_fresh + [aged]), rule))
    assert isinstance(acts["b-aged"], Place) and "aged past" in acts["b-aged"].reason


def test_a_long_served_job_is_protected_for_two_minutes_only():
    """Anti-thrash protects a moved job for ``min_move_interval_s`` (600 s), but a job of the top
    service class (``long_move_after_s``: 10 device-hours) only for ``long_move_interval_s``
    (120 s): in a burst of new jobs, the first ones' moves otherwise protected every long job
    the next ones should take from, and the new jobs waited."""
    def node(attained_h: float, moved_ago: float):
        return [running(f"r-{i}", S, 1, {"node-0": (i,)}, user="a", submitted_at=NOW - 40 * HOUR,
                        ckpt=NOW - moved_ago, moved=NOW - moved_ago, attained=attained_h * HOUR,
                        ran=attained_h * HOUR) for i in range(8)]
    new = waiting("b-new", B, 1, submitted_at=NOW - 60)
    snap = snapshot(NOW, {"node-0": 8}, node(12.0, 180.0) + [new])
    acts = by_job(singularity_policy(snap, POOL))
    assert isinstance(acts["b-new"], Place) and sum(isinstance(a, Preempt) for a in acts.values()) == 1
    # the wrong policy (one interval for every job) leaves it waiting
    assert singularity_policy(snap, PolicyConfig(long_move_interval_s=None)) == []
    # still protected within the two minutes, and a job under 10 device-hours for the full 600 s
    assert singularity_policy(snapshot(NOW, {"node-0": 8}, node(12.0, 60.0) + [new]), POOL) == []
    assert singularity_policy(snapshot(NOW, {"node-0": 8}, node(5.0, 180.0) + [new]), POOL) == []
    assert isinstance(by_job(singularity_policy(snapshot(NOW, {"node-0": 8}, node(5.0, 700.0) + [new]),
                                                POOL))["b-new"], Place)
