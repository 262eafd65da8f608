"""Least attained service within a tier, aging by waiting time, starvation horizon.

Tests that pin the per-tier rules run with ``PER_TIER``; the shared pool of standard and basic
work (the default) is pinned in test_sched_pool.py.

Attained service (``JobView.attained_s``, device-seconds) orders the waiting jobs of a tier and
lets a waiting job take devices from same-tier jobs that have had far more service: standard
jobs are only ever shrunk for that, basic jobs shrunk, then preempted; premium jobs and jobs
moved recently never. Left at 0 (a server that does not fill it) nothing of this happens.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from backend.scheduler.simulator import Simulator
from backend.scheduler.singularity import PolicyConfig, SingularityPolicy, singularity_policy
from backend.scheduler.trace import TraceJob
from backend.scheduler.types import Place, Preempt, Resize
from sched_helpers import B, P, S, apply, by_job, ndev, running, snapshot, waiting
from singularity_sdk.protocol import JobState

NOW = 1_000_000.0
HOUR = 3600.0
#: each tier alone, basic shrinkable to one device (the rules before the shared pool)
PER_TIER = PolicyConfig(las_across=False, basic_min_fraction=0.0)


def _blocked(*jobs):
    """node-0 with one free device (a premium job holds the other seven), and ``jobs`` waiting."""
    blocker = running("x", P, 7, {"node-0": tuple(range(7))}, submitted_at=NOW - HOUR)
    return snapshot(NOW, {"node-0": 8}, [blocker, *jobs])


def test_waiting_jobs_of_a_tier_go_least_attained_service_first():
    def served(submitted_ago: float, attained: float = 5 * HOUR, ran=5 * HOUR):
        return waiting("served", S, 1, submitted_at=NOW - submitted_ago, state=JobState.PREEMPTED,
                       attained=attained, ran=ran)

    new = waiting("new", S, 1, submitted_at=NOW - 60)
    assert [a.job_id for a in singularity_policy(_blocked(served(10 * HOUR), new))] == ["new"]
    # without service data (a server that leaves attained_s at 0): FIFO as before
    plain = served(10 * HOUR, attained=0.0, ran=None)
    assert [a.job_id for a in singularity_policy(_blocked(plain, new))] == ["served"]
    # and the ordering can be switched off
    no_las = PolicyConfig(las_order=False)
    assert [a.job_id for a in singularity_policy(_blocked(served(10 * HOUR), new), no_las)] == ["served"]
    # a job that has waited past the starvation horizon (55 h of its 60) goes first whatever its service
    assert [a.job_id for a in singularity_policy(_blocked(served(60 * HOUR), new))] == ["served"]
    # with ran_s unknown, a preempted job's wait counts from its preemption, not its submission
    unknown = replace(served(60 * HOUR, ran=None), last_moved_at=NOW - HOUR)
    assert [a.job_id for a in singularity_policy(_blocked(unknown, new))] == ["new"]


def _long_standard(attained: float, sla=S, moved=None, gpus: int = 8):
    return running("long", sla, gpus, {"node-0": tuple(range(gpus))}, user="a", submitted_at=NOW - 3 * HOUR,
                   attained=attained, ran=attained / gpus, moved=moved)


def test_standard_job_with_far_more_service_is_shrunk_for_a_new_standard_job():
    # same user on both sides, so fair share does not apply: only least attained service does
    short = waiting("short", S, 1, user="a", submitted_at=NOW - 60)
    snap = snapshot(NOW, {"node-0": 8}, [_long_standard(2 * HOUR), short])
    actions = singularity_policy(snap)
    after = apply(snap, actions)
    acts = by_job(actions)
    assert set(acts) == {"long", "short"}
    assert isinstance(acts["long"], Resize) and ndev(after["long"]) == 4  # to half, never below
    assert isinstance(acts["short"], Place) and ndev(after["short"]) == 1
    assert "least attained service" in acts["long"].reason and "2.00 device-hours" in acts["long"].reason
    assert "least attained service" in acts["short"].reason
    assert actions.index(acts["long"]) < actions.index(acts["short"])


@pytest.mark.parametrize(
    "case",
    [
        "too little service",  # 0.5 device-hours: one class above the waiting job, two are needed
        "moved recently",  # anti-thrash
        "premium",  # never shrunk for anyone
        "switched off",
        "waiting job has service too",  # 2 vs 20 device-hours: one class apart
    ],
)
def test_same_tier_las_shrink_only_when_allowed(case):
    attained, sla, moved, cfg = 2 * HOUR, S, None, PolicyConfig()
    short = waiting("short", S, 1, user="a", submitted_at=NOW - 60)
    if case == "too little service":
        attained = 0.5 * HOUR
    elif case == "moved recently":
        moved = NOW - 60
    elif case == "premium":
        sla = P
    elif case == "switched off":
        cfg = PolicyConfig(las_take=False)
    else:
        attained = 20 * HOUR
        short = waiting("short", S, 1, user="a", submitted_at=NOW - 3 * HOUR, state=JobState.PREEMPTED,
                        attained=2 * HOUR, ran=2 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [_long_standard(attained, sla, moved), short])
    assert singularity_policy(snap, cfg) == []


def test_per_tier_mode_never_preempts_standard_jobs_for_standard_work():
    ones = [running(f"s1-{i}", S, 1, {"node-0": (i,)}, user="a", submitted_at=NOW - 50 * HOUR,
                    attained=40 * HOUR, ran=40 * HOUR) for i in range(8)]
    snap = snapshot(NOW, {"node-0": 8}, ones + [waiting("new", S, 1, user="a", submitted_at=NOW - 60)])
    assert singularity_policy(snap, PER_TIER) == []
    # in one pool (the default) the long-served job that loses least work makes room
    acts = by_job(singularity_policy(snap))
    assert set(acts) == {"s1-0", "new"} and isinstance(acts["s1-0"], Preempt)


def test_basic_jobs_with_far_more_service_are_shrunk_then_preempted_for_a_new_basic_job():
    cfg = PER_TIER
    def basic_ones(n, start=0):
        return [running(f"b-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - 3 * HOUR, ckpt=NOW - 1000 + i,
                        attained=2.5 * HOUR, ran=2.5 * HOUR) for i in range(start, n)]

    new = waiting("b-new", B, 1, submitted_at=NOW - 60)
    # a spliceable basic job is there: shrinking it is cheaper than preempting anyone
    wide = running("b-wide", B, 2, {"node-0": (6, 7)}, submitted_at=NOW - 3 * HOUR, attained=5 * HOUR, ran=2.5 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, basic_ones(6) + [wide, new])
    acts = by_job(singularity_policy(snap, cfg))
    assert set(acts) == {"b-wide", "b-new"} and isinstance(acts["b-wide"], Resize)
    # only 1-device jobs: the one that loses least work (newest checkpoint) is preempted
    snap = snapshot(NOW, {"node-0": 8}, basic_ones(8) + [new])
    actions = singularity_policy(snap, cfg)
    apply(snap, actions)
    acts = by_job(actions)
    assert set(acts) == {"b-7", "b-new"} and isinstance(acts["b-7"], Preempt)
    assert "least attained service first in the basic tier" in acts["b-7"].reason
    # a basic job that has waited past the aging horizon counts as standard: basic work cannot take it
    aged = [running(f"b-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - 8 * HOUR, attained=2.5 * HOUR, ran=2.5 * HOUR)
            for i in range(8)]  # waited 5.5 h of its 8
    assert singularity_policy(snapshot(NOW, {"node-0": 8}, aged + [new]), cfg) == []


def test_aging_counts_waiting_time_not_time_in_the_system():
    # in the system 6 h but ran all of it: still basic, so a premium job may shrink it to 1
    ran_all = running("b", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - 6 * HOUR, ran=6 * HOUR,
                      attained=48 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [ran_all, waiting("p", P, 7, submitted_at=NOW)])
    after = apply(snap, singularity_policy(snap, PER_TIER))
    assert ndev(after["b"]) == 1
    # waited 5 h of its 6 (or unknown, ran_s None: 6 h in the system): treated as standard, half at most
    for ran in (1 * HOUR, None):
        waited = running("b", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - 6 * HOUR, ran=ran)
        snap = snapshot(NOW, {"node-0": 8}, [waited, waiting("p", P, 2, submitted_at=NOW)])
        after = apply(snap, singularity_policy(snap, PER_TIER))
        assert ndev(after["b"]) == 4, ran


def test_a_starving_job_gets_a_node_held_back_for_it():
    prem = [running(f"p0-{i}", P, 1, {"node-0": (i,)}, submitted_at=NOW - HOUR) for i in range(6)]
    prem += [running(f"p1-{i}", P, 1, {"node-1": (i,)}, submitted_at=NOW - HOUR) for i in range(7)]
    small = [waiting(f"s-{i}", S, 1, submitted_at=NOW - 60 + i) for i in range(2)]
    nodes = {"node-0": 8, "node-1": 8}
    # a 3-device standard job (minimum 3) that has waited 50 h fits nowhere: node-0, with the
    # most free devices, is held for it, and the small jobs only get node-1's device
    big = waiting("big", S, 3, submitted_at=NOW - 50 * HOUR)
    acts = by_job(singularity_policy(snapshot(NOW, nodes, prem + small + [big])))
    assert set(acts) == {"s-0"} and set(acts["s-0"].placement) == {"node-1"}
    # before the horizon nothing is held back
    young = waiting("big", S, 3, submitted_at=NOW - 10 * HOUR)
    acts = by_job(singularity_policy(snapshot(NOW, nodes, prem + small + [young])))
    assert set(acts) == {"s-0", "s-1"}


def test_the_simulator_fills_attained_service_and_run_time():
    seen = {}
    inner = SingularityPolicy()

    def policy(snap):
        for j in snap.jobs:
            seen.setdefault(j.id, []).append((snap.now, j.state, j.placed_devices, j.attained_s, j.ran_s))
        return inner(snap)

    policy.min_move_interval_s = inner.min_move_interval_s
    jobs = [TraceJob("a", 0.0, 1000.0, 2, "u", S), TraceJob("b", 400.0, 100.0, 1, "u", S)]
    sim = Simulator(jobs, 2, 2, 30.0, policy=policy)
    sim.run()
    # "a" started at 0 on both devices; at 400 "b" arrives: a has had 800 device-seconds in 400 s
    t, state, held, attained, ran = next(x for x in seen["a"] if x[0] == 400.0)
    assert (state, held) == (JobState.RUNNING, 2)
    assert attained == pytest.approx(800.0) and ran == pytest.approx(400.0)
    # "b" waits: nothing attained yet
    assert seen["b"][0][3:] == (0.0, 0.0)
