"""Taking a checkpoint at a safe point: written in line, or snapshotted and written behind the loop.

Called by the runtime when its controller hands it a request. The events say how it went:
``checkpoint_started``, then ``checkpointed`` once the checkpoint has committed (for a write
behind the loop, when that write has), or ``checkpoint_failed`` (the program runs on, its
state untouched). A request with ``then='stop'`` ends in `Preempted` once every rank has written.
"""
from __future__ import annotations

import time
from typing import Optional

from .checkpoint_request import CheckpointRequest
from ..checkpoint.errors import CheckpointFailure, Preempted
from .ports import RuntimeView
from .state import write_checkpoint


def take(rt: RuntimeView, request: CheckpointRequest, boundary: Optional[int]) -> None:
    """Take ``request`` at this safe point (``boundary``: the statement a boundary safe point is at)."""
    ctl = rt.ctl
    started = time.monotonic()
    wait_s = max(0.0, started - request.requested_at)
    label = rt.step if request.label is None else request.label
    ctl.emit("checkpoint_started", {"step": label, "reason": request.reason, "then": request.then})
    failure: Optional[dict] = None
    try:
        if writes_behind(rt, request):  # snapshot now; write and report behind the loop
            _write_behind(rt, boundary, label, started, wait_s)
            return
        ref, nbytes, rebuilt = write_checkpoint(rt, boundary, label)
    except CheckpointFailure as e:
        failure = {"error": str(e), "variables": e.variables}
    except Exception as e:  # disk full, permissions...: report, keep running
        failure = {"error": f"{type(e).__name__}: {e}", "variables": []}
    if failure is not None:
        ctl.emit("checkpoint_failed", failure)
    if not ctl.all_written(failure is None) or failure is not None:
        return  # every rank of the job runs on: none stops at a checkpoint another rank lacks
    ctl.checkpoint_written()
    ctl.emit("checkpointed", {"step": label, "bytes": nbytes, "seconds": time.monotonic() - started,
                              "wait_s": wait_s, "path": str(ref.path), "rebuilt": rebuilt})
    if request.then == "stop":
        rt.preempting = True
        rt.preempted_exc = Preempted(ref)
        raise rt.preempted_exc


def writes_behind(rt: RuntimeView, request: CheckpointRequest) -> bool:
    """Whether this checkpoint may be written behind the loop (background.py says why only these)."""
    ctl = rt.ctl
    return request.then == "continue" and ctl.world_size == 1 and ctl.write_behind


def _write_behind(rt: RuntimeView, boundary: Optional[int], label: int, started: float, wait_s: float) -> None:
    """Snapshot now (a `CheckpointFailure` is raised here, as for a write), write and report behind."""
    ctl = rt.ctl
    snap, nbytes, rebuilt = write_checkpoint(rt, boundary, label, snapshot=True)
    snapshot_s = time.monotonic() - started
    ctl.checkpoint_written()

    def job() -> None:
        try:
            ref = ctl.store.write(label, ctl.rank, 1, snap.write_to)
        except Exception as e:  # disk full, permissions: the job runs on, the previous one stays
            ctl.emit("checkpoint_failed", {"error": f"{type(e).__name__}: {e}", "variables": []})
            return
        ctl.emit("checkpointed", {"step": label, "bytes": nbytes, "seconds": time.monotonic() - started,
                                  "snapshot_s": snapshot_s, "wait_s": wait_s, "path": str(ref.path),
                                  "rebuilt": rebuilt, "background": True})

    ctl.writer.submit(job)
