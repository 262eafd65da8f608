"""A checkpoint asked of a running program, and how two pending requests become one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

Then = Literal["continue", "stop"]


@dataclass
class CheckpointRequest:
    """A checkpoint asked of the program, taken at its next safe point; ``then`` is "continue"
    or "stop" (exit after it), ``reason`` what the events say."""

    then: str
    reason: str
    requested_at: float
    #: the checkpoint's number when the ranks of a job agreed on one (their own safe-point
    #: counts may differ: a loop only rank 0 runs); None = this rank's step
    label: Optional[int] = None
    #: monotonic time by which a safe point must take it, else it is answered checkpoint_failed
    deadline: Optional[float] = None
    #: safe points that were no place for it (autograd_graphs.py): it waited for the next one
    #: (those at which the held graph only grew, an accumulation under way, are not counted)
    deferred: int = 0
    #: the graph nodes held at the last of them (autograd_graphs.nodes), to tell growth
    graph_nodes: Optional[list[Any]] = field(default=None, repr=False, compare=False)
    #: a weak reference to the tensor deep in the state whose graph stopped the last save
    #: (autograd_graphs.GraphFound): while its graph is still to be used, no save is tried
    deep_graph: Optional[Any] = field(default=None, repr=False, compare=False)


def merge(a: Optional[CheckpointRequest], b: CheckpointRequest) -> CheckpointRequest:
    """Two pending requests become one; 'stop' wins, the earlier request time is kept (for wait_s)."""
    if a is None:
        return b
    upgrade = b.then == "stop" and a.then != "stop"
    bounds = [d for d in (a.deadline, b.deadline) if d is not None]
    return CheckpointRequest("stop" if upgrade else a.then, b.reason if upgrade else a.reason,
                             min(a.requested_at, b.requested_at), deadline=min(bounds) if bounds else None,
                             deferred=max(a.deferred, b.deferred),
                             graph_nodes=a.graph_nodes if a.graph_nodes is not None else b.graph_nodes,
                             deep_graph=a.deep_graph if a.deep_graph is not None else b.deep_graph)
