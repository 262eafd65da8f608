"""A job whose checkpoint resumes exactly only on some nodes (``JobView.nodes``) is placed only
there, by both policies; it takes nothing from others for it, and it does not hold up the jobs
behind it."""
from __future__ import annotations

import dataclasses

from backend.scheduler.fifo import fifo_policy
from backend.scheduler.placement import FreeDevices
from backend.scheduler.singularity import singularity_policy
from backend.scheduler.types import Place, Preempt
from sched_helpers import B, P, S, running, snapshot, waiting


def _only(job, *nodes):
    return dataclasses.replace(job, nodes=frozenset(nodes))


def test_free_devices_pick_among_allowed_nodes_only():
    snap = snapshot(0, {"a": 4, "b": 2, "c": 4}, [running("x", S, 2, {"a": (0, 1)})])
    free = FreeDevices(snap.nodes)
    assert free.pick(2, only=frozenset({"c"})) == {"c": (0, 1)}
    assert free.pick(2, only=frozenset({"a", "c"})) == {"a": (2, 3)}  # the fullest allowed node that fits
    assert free.pick(6, only=frozenset({"b", "c"})) == {"c": (0, 1, 2, 3), "b": (0, 1)}
    assert free.pick(3, only=frozenset({"b"})) is None
    assert free.pick(1, only=frozenset({"gone"})) is None


def test_both_policies_place_a_restricted_job_only_where_it_resumes_exactly():
    queued = _only(waiting("r", S, 2, submitted_at=1), "c")
    later = waiting("w", S, 2, submitted_at=2)
    snap = snapshot(10, {"b": 2, "c": 2}, [queued, later])
    for policy in (fifo_policy, singularity_policy):
        places = {a.job_id: a.placement for a in policy(snap) if isinstance(a, Place)}
        assert places["r"] == {"c": (0, 1)}, policy
        assert places["w"] == {"b": (0, 1)}, policy


def test_a_restricted_job_waits_takes_nothing_and_does_not_block_others():
    snap = snapshot(10, {"b": 2, "c": 2}, [
        running("basic", B, 2, {"c": (0, 1)}, submitted_at=0),
        _only(waiting("r", P, 2, submitted_at=1), "c", "gone"),  # premium: could preempt basic
        waiting("w", S, 2, submitted_at=2),
    ])
    actions = singularity_policy(snap)
    assert not [a for a in actions if isinstance(a, Place) and a.job_id == "r"]
    assert not [a for a in actions if isinstance(a, Preempt)]
    assert [a.placement for a in actions if isinstance(a, Place) and a.job_id == "w"] == [{"b": (0, 1)}]


def test_free_devices_pick_is_one_rule_over_the_nodes_that_pass_the_filter():
    snap = snapshot(0, {"a": 4, "b": 4, "c": 2, "d": 2}, [running("x", S, 2, {"a": (0, 1)})])
    free = FreeDevices(snap.nodes)
    # a migration leaving a: best fit among the rest (c has the fewest free that still fit)
    assert free.pick(2, exclude={"a"}) == {"c": (0, 1)}
    # fits one node (D = 4) yet no node but the one it leaves has 4 free: it waits, never split
    assert free.pick(4, exclude={"b"}) is None
    # D over the nodes it may use: 4 devices over two nodes of 2 take both whole
    assert free.pick(4, only=frozenset({"c", "d"})) == {"c": (0, 1), "d": (0, 1)}
    # a node it prefers comes first whether or not it is restricted
    assert free.pick(2, prefer=["b"], only=frozenset({"a", "b"})) == {"b": (0, 1)}
    assert free.pick(2, prefer=["b"]) == {"b": (0, 1)}
