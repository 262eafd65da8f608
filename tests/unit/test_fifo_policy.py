"""Scheduler v0: FIFO, gang, one node when it fits, strict order."""
from singularity_sdk.protocol import SLA, JobState
from backend.scheduler.fifo import fifo_policy
from backend.scheduler.types import JobView, NodeView, Place, Snapshot


def job(id, gpus, t, state=JobState.QUEUED, placement=None):
    return JobView(id=id, user="u", sla=SLA.STANDARD, state=state, gpus=gpus, submitted_at=t, placement=placement or {})


def nodes(*specs):
    return tuple(NodeView(name=n, devices=tuple(range(d)), used=u) for n, d, u in specs)


def test_places_in_submit_order_on_one_node_best_fit():
    snap = Snapshot(now=0, nodes=nodes(("a", 2, {0: "x"}), ("b", 2, {})),
                    jobs=(job("j2", 1, 2.0), job("j1", 2, 1.0)))
    actions = fifo_policy(snap)
    assert actions == [Place("j1", {"b": (0, 1)}, actions[0].reason), Place("j2", {"a": (1,)}, actions[1].reason)]
    assert "fifo" in actions[0].reason


def test_head_of_queue_blocks_the_rest():
    snap = Snapshot(now=0, nodes=nodes(("a", 2, {0: "x"})), jobs=(job("big", 2, 1.0), job("small", 1, 2.0)))
    assert fifo_policy(snap) == []


def test_spans_nodes_when_no_single_node_fits():
    snap = Snapshot(now=0, nodes=nodes(("a", 2, {0: "x"}), ("b", 2, {})), jobs=(job("j", 3, 1.0),))
    (action,) = fifo_policy(snap)
    assert action.placement == {"b": (0, 1), "a": (1,)}


def test_unschedulable_nodes_are_skipped():
    n = (NodeView(name="a", devices=(0, 1), schedulable=False), NodeView(name="b", devices=(0,)))
    snap = Snapshot(now=0, nodes=n, jobs=(job("j", 1, 1.0),))
    assert fifo_policy(snap)[0].placement == {"b": (0,)}


def test_a_job_that_fits_one_node_waits_for_one_rather_than_split():
    # the shared locality rule (placement.py): 2 devices, the size of a node, run on one node
    snap = Snapshot(now=0, nodes=nodes(("a", 2, {0: "x"}), ("b", 2, {0: "y"})), jobs=(job("j", 2, 1.0),))
    assert fifo_policy(snap) == []


def test_a_restricted_job_is_placed_only_on_its_nodes():
    snap = Snapshot(now=0, nodes=nodes(("a", 2, {0: "x"}), ("b", 2, {})),
                    jobs=(JobView(id="j", user="u", sla=SLA.STANDARD, state=JobState.QUEUED, gpus=1, submitted_at=1.0,
                                  nodes=frozenset({"b"})),))
    assert fifo_policy(snap)[0].placement == {"b": (0,)}
