"""Bounds that keep one round cheap: at most ``max_takes_per_round`` waiting jobs are placed by
taking devices from running jobs; the others wait for the next round, free devices still go."""
from __future__ import annotations

from backend.scheduler.round_state import RoundState
from backend.scheduler.singularity import PolicyConfig, singularity_policy
from backend.scheduler.types import Place, Preempt
from sched_helpers import B, P, apply, by_job, running, snapshot, waiting

NOW = 1_000_000.0


def _crowded(n_nodes: int = 4):
    """Every device held by an old 1-device basic job; one premium job waits per device, and
    one more node is entirely free."""
    nodes = {f"node-{i}": 8 for i in range(n_nodes)}
    nodes["spare"] = 2
    jobs = [
        running(f"b-{i}-{d}", B, 1, {f"node-{i}": (d,)}, submitted_at=NOW - 7200, ckpt=NOW - 3600,
                attained=7200.0, ran=7200.0)
        for i in range(n_nodes) for d in range(8)
    ]
    jobs += [waiting(f"p-{k}", P, 1, submitted_at=NOW - 100 + k) for k in range(n_nodes * 8 + 2)]
    return snapshot(NOW, nodes, jobs)


def _placed_by_taking(actions):
    acts = by_job(actions)
    preempted = {a.job_id for a in actions if isinstance(a, Preempt)}
    return preempted, [j for j, a in acts.items() if isinstance(a, Place) and j.startswith("p-")]


def test_takes_per_round_are_bounded_and_free_devices_still_go():
    snap = _crowded()
    actions = singularity_policy(snap, PolicyConfig(max_takes_per_round=3))
    apply(snap, actions)
    preempted, placed = _placed_by_taking(actions)
    assert len(preempted) == 3  # three takes, one victim each
    # the two free devices of the spare node go first (oldest first), then three takes
    assert placed == [f"p-{k}" for k in range(5)]


def test_without_the_bound_every_waiting_job_takes():
    snap = _crowded()
    actions = singularity_policy(snap, PolicyConfig(max_takes_per_round=None))
    apply(snap, actions)
    preempted, placed = _placed_by_taking(actions)
    assert len(preempted) == 32 and len(placed) == 34


def test_the_node_bound_is_recomputed_when_devices_change():
    """``reclaim_candidates`` keeps, per category set, the most any node could offer, and answers
    [] below it; once devices free up, the bound is recomputed rather than kept."""
    jobs = [running(f"p-{d}", P, 1, {"node-0": (d,)}, submitted_at=NOW - 7200) for d in range(6)]
    jobs += [running(f"b-{d}", B, 1, {"node-0": (d,)}, submitted_at=NOW - 7200, ckpt=NOW - 3600 + d)
             for d in (6, 7)]
    snap = snapshot(NOW, {"node-0": 8, "spare": 2}, jobs)
    st = RoundState(snap, PolicyConfig())
    preempt_basic = (1,)
    assert st.reclaim_candidates(3, preempt_basic, limit=4) == []  # 2 basic devices, 2 free on spare
    st.give_devices({"node-0": (0,)})  # a premium job's device frees up: 1 free + 2 basic on node-0
    assert st.reclaim_candidates(3, preempt_basic, limit=4) == [0]
    fresh = RoundState(snap, PolicyConfig())
    fresh.give_devices({"node-0": (0,)})
    assert fresh.reclaim_candidates(3, preempt_basic, limit=4) == [0]
