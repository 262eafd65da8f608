"""A finished job becomes the cell's outcome: its value, its variables, or its remote error.

The result payload is fetched once: it holds both the pickled value of the last expression
and the pickled variables. The variables are checked against the pull limit before anything is
unpickled, so a job that built a huge object does not fill the notebook's memory by surprise.
Errors carry ``_render_traceback_`` so IPython (and a kernel's error reply) shows the remote
traceback, not the magic's own frames.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, MutableMapping

from singularity_sdk import Job, unpickle
from singularity_sdk.errors import APIError, JobCancelled, JobFailed
from singularity_sdk.protocol import JobState


class RemoteCellError(JobFailed):
    """The cell raised on the cluster. Shown as the remote traceback."""

    def __str__(self) -> str:
        lines = [ln for ln in self.traceback.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"job {self.job_id} failed"

    def _render_traceback_(self) -> list[str]:
        return [f"Job {self.job_id} failed on the cluster; remote traceback:", *self.traceback.rstrip().splitlines()]


class CellJobCancelled(JobCancelled):
    def _render_traceback_(self) -> list[str]:
        return [str(self)]


@dataclass
class Pulled:
    """What came back into the notebook namespace, and what did not (with why)."""

    names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def outcome(job: Job) -> Any:
    """The job's final payload; raises ``RemoteCellError`` / ``CellJobCancelled`` when it has none."""
    job.refresh()
    if job.state == JobState.FAILED:
        raise RemoteCellError(job.id, job.info.error or "(no traceback recorded)")
    if job.state == JobState.CANCELLED:
        raise CellJobCancelled(f"job {job.id} was cancelled; the cell has no result")
    return job.result_payload()


def value_of(job: Job, payload: dict[str, Any]) -> tuple[Any, list[str]]:
    """The last expression's value (None when it could not be kept, with a note saying why)."""
    try:
        return job.decode_result(payload), []
    except APIError as exc:
        return None, [exc.message]
    except Exception as exc:  # unpickling needs something the notebook lacks (a module, a device)
        return None, [f"the cell's value could not be loaded here: {type(exc).__name__}: {exc}"]


def pull(payload: dict[str, Any], namespace: MutableMapping[str, Any], limit_mb: float) -> Pulled:
    """Put the job's variables into ``namespace`` unless their pickled size is over ``limit_mb``."""
    out = Pulled()
    for name, why in (payload.get("outputs_skipped") or {}).items():
        out.notes.append(f"{name} was not brought back: {why}")
    blob = payload.get("outputs_b64")
    if not blob:
        return out
    size = len(blob) * 3 // 4
    if size > limit_mb * 1e6:
        out.notes.append(
            f"the job's variables are {size / 1e6:.1f} MB, over the pull limit of {limit_mb:g} MB: none were "
            f"brought back. Get them with job.outputs(), or raise the limit: %singularity_config --pull-limit-mb N")
        return out
    try:
        values = unpickle.loads(base64.b64decode(blob), main_globals=namespace)
    except Exception as exc:
        out.notes.append(f"the job's variables could not be loaded here ({type(exc).__name__}: {exc}); "
                         f"nothing was brought back")
        return out
    namespace.update(values)
    out.names = list(values)
    return out
