"""Job controls shared by the widget's buttons and the ``%singularity`` line commands.

Each action returns quickly (it never waits for the job to react: the event stream shows the
outcome), and every failure becomes one sentence for the user: an older server that does not
offer an action answers 404 "unknown action", which is shown as "not available on this server
yet", not as a traceback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from singularity_sdk import Client
from singularity_sdk.errors import APIError, SingularityError
from singularity_sdk.protocol import JobInfo

ACTIONS = ("preempt", "resume", "migrate", "resize", "cancel", "checkpoint")


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str
    info: Optional[JobInfo] = None


def perform(client: Client, job_id: str, action: str, *, reason: str = "", node: Optional[str] = None,
            gpus: Optional[int] = None) -> Outcome:
    """POST ``/jobs/{id}/{action}`` and describe what happened."""
    if action not in ACTIONS:
        return Outcome(False, f"unknown action {action!r}; valid: {', '.join(ACTIONS)}")
    body: dict[str, Any] = {}
    if node:
        body["node"] = node
    if gpus is not None:
        body["gpus"] = gpus
    try:
        info = client.get(job_id).act(action, reason, **body).info
    except APIError as exc:
        if exc.status == 404 and "unknown action" in exc.message:
            return Outcome(False, f"{action} is not available on this server yet ({exc.message})")
        return Outcome(False, f"{action} refused: {exc.message}")
    except SingularityError as exc:
        return Outcome(False, f"{action} failed: {exc}")
    return Outcome(True, _done_text(action, node, gpus), info)


def _done_text(action: str, node: Optional[str], gpus: Optional[int]) -> str:
    return {
        "preempt": "preemption requested: the job checkpoints at its next safe point",
        "resume": "resume requested: the job is queued and continues from its checkpoint",
        "migrate": f"migration requested{' to ' + node if node else ''}",
        "resize": f"resize to {gpus} device(s) requested",
        "cancel": "cancel requested",
        "checkpoint": "checkpoint requested",
    }[action]
