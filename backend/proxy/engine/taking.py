"""Taking a checkpoint at a safe point: written in line, or snapshotted and written behind the loop.

Called by the runtime when its controller hands it a request. The events say how it went:
``checkpoint_started``, then ``checkpointed`` once the checkpoint has committed (for a write
behind the loop, when that write has), or ``checkpoint_failed`` (the program runs on, its
state untouched). A request with ``then='stop'`` ends in `Preempted` once every rank has written.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from ..checkpoint import fingerprint
from ..checkpoint.errors import CheckpointFailure, Preempted
from . import autograd_graphs
from .background import Snapshot
from .checkpoint_request import CheckpointRequest
from .ports import RuntimeView
from .state import graphs_in_use, write_checkpoint


def take(rt: RuntimeView, request: CheckpointRequest, boundary: Optional[int]) -> None:
    """Take ``request`` at this safe point (``boundary``: the statement a boundary safe point is at)."""
    ctl = rt.ctl
    started = time.monotonic()
    wait_s = max(0.0, started - request.requested_at)
    label = rt.step if request.label is None else request.label
    held = graphs_in_use(rt)
    deep = autograd_graphs.still_held(request.deep_graph) if held is None else None
    held = held or deep
    cut = False
    if held is not None and ctl.world_size == 1:
        cut = _cut_or_defer(rt, request, held, wait_s, deep=deep is not None)
        if not cut:  # wait for the next safe point
            return
    depends_on = fingerprint.for_event()  # now, on the program's thread (see for_event)
    started_event = {"step": label, "reason": request.reason, "then": request.then}
    if cut:  # waited long enough: a graph nothing backpropagates would hold checkpoints off for good
        started_event["cut_graphs"] = sorted(set(held.tensors.values()))
    ctl.emit("checkpoint_started", started_event)
    failure: Optional[dict] = None
    behind = writes_behind(rt, request)
    try:
        if held is not None and not cut:  # several ranks must agree on a safe point: fail
            raise CheckpointFailure(held.why)
        # a graph deeper in the state than a variable stops the save (GraphFound) until patience is over
        cut_deep = ctl.world_size == 1 and autograd_graphs.patience_over(request.deferred, wait_s)
        with autograd_graphs.cutting(held) if cut else contextlib.nullcontext(), \
                autograd_graphs.watching(cut_deep):
            if behind:  # snapshot now; write and report behind the loop
                snap, nbytes, rebuilt = write_checkpoint(rt, boundary, label, snapshot=True)
            else:
                ref, nbytes, rebuilt = write_checkpoint(rt, boundary, label)
    except autograd_graphs.GraphFound as e:
        if ctl.world_size == 1:  # not taken: the request waits for the next safe point
            request.deep_graph = e.tensor_ref
            _cut_or_defer(rt, request, e.held, wait_s, deep=True)
            return
        failure = {"error": str(e), "variables": []}
    except CheckpointFailure as e:
        failure = {"error": str(e), "variables": e.variables}
    except Exception as e:  # disk full, permissions...: report, keep running
        failure = {"error": f"{type(e).__name__}: {e}", "variables": []}
    if failure is not None:
        ctl.emit("checkpoint_failed", failure)
    # every rank of the job runs on: none stops at, or writes, a checkpoint another rank lacks
    if not ctl.all_written(failure is None) or failure is not None:
        return
    ctl.checkpoint_written()
    if behind:
        _write_behind(rt, snap, label, nbytes, rebuilt, started, wait_s, depends_on)
        return
    ctl.emit("checkpointed", {"step": label, "bytes": nbytes, "seconds": time.monotonic() - started,
                              "wait_s": wait_s, "path": str(ref.path), "rebuilt": rebuilt,
                              "fingerprint": depends_on})
    if request.then == "stop":
        rt.preempting = True
        rt.preempted_exc = Preempted(ref)
        raise rt.preempted_exc


def _cut_or_defer(rt: RuntimeView, request: CheckpointRequest, held: autograd_graphs.GraphsHeld,
                  wait_s: float, deep: bool = False) -> bool:
    """A safe point where graphs still to be used are held: True when the request has waited
    long enough to take the checkpoint with them cut, else deferred to the next safe point.
    ``deep``: found by a save, which stops at the first one (a list of log-probs growing over an
    episode shows as one tensor): only the seconds' patience counts."""
    growing = deep or autograd_graphs.grows(held, request.graph_nodes)
    request.graph_nodes = autograd_graphs.nodes(held)
    if autograd_graphs.patience_over(request.deferred, wait_s):
        return True
    rt.ctl.defer(request, held.why, counts=not growing)
    return False


def writes_behind(rt: RuntimeView, request: CheckpointRequest) -> bool:
    """Whether this checkpoint may be written behind the loop: one the job runs on after (the
    same answer on every rank of a job: the request and the setting are the job's)."""
    return request.then == "continue" and rt.ctl.write_behind


def _write_behind(rt: RuntimeView, snap: Snapshot, label: int, nbytes: int, rebuilt: list,
                  started: float, wait_s: float, depends_on: dict) -> None:
    """Write the snapshot every rank took (they agreed it was taken) in the background and report
    when it has committed; for several ranks the last part in commits the set (store.py)."""
    ctl = rt.ctl
    snapshot_s = time.monotonic() - started

    def job() -> None:
        try:
            ref = ctl.store.write(label, ctl.rank, ctl.world_size, snap.write_to)
        except Exception as e:  # disk full, permissions: the job runs on, the previous one stays
            ctl.emit("checkpoint_failed", {"error": f"{type(e).__name__}: {e}", "variables": []})
            return
        ctl.emit("checkpointed", {"step": label, "bytes": nbytes, "seconds": time.monotonic() - started,
                                  "snapshot_s": snapshot_s, "wait_s": wait_s, "path": str(ref.path),
                                  "rebuilt": rebuilt, "background": True, "fingerprint": depends_on})

    ctl.writer.submit(job)
