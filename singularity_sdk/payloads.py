"""One typed model per event payload: what each kind of event in a job's log carries.

``Event.data`` stays a plain dict on the wire (old and new servers and clients read each other's
events); ``of(event)`` gives the typed view that the CLI's renderer and the notebook widget read,
and the server reads what agents report through the same models (``decode(..., strict=True)``).
Fields are optional (an older server may not send one) and unknown fields are kept (a newer
server may send more); a field of the wrong type is an error.
tests/e2e/test_payloads.py checks the events of real jobs against these models.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from .protocol import Event, EventType, Placement



class Payload(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class Submitted(Payload):
    user: Optional[str] = None
    name: Optional[str] = None
    gpus: Optional[int] = None
    ranks: Optional[int] = None
    sla: Optional[str] = None
    kind: Optional[str] = None


class Scheduled(Payload):
    placement: list[Placement] = Field(default_factory=list)
    attempt: Optional[int] = None
    reason: str = ""


class Started(Payload):
    node: Optional[str] = None
    ranks: list[int] = Field(default_factory=list)
    pids: dict[str, int] = Field(default_factory=dict)
    devices: list[int] = Field(default_factory=list)
    attempt: Optional[int] = None
    #: through a store: seconds spent fetching the checkpoint before the start, and how many of its
    #: bytes the node had copied while the source was still writing and uploading it
    fetch_s: Optional[float] = None
    prefetched_bytes: Optional[int] = None
    #: bytes of the checkpoint's blobs this node held already (linked, not fetched)
    linked_bytes: Optional[int] = None


class Log(Payload):
    rank: int = 0
    stream: str = "stdout"
    line: str = ""


class Progress(Payload):
    step: Optional[int] = None


class Result(Payload):
    repr: str = ""
    bytes: Optional[int] = None
    error: Optional[str] = None
    # the agent's report only: the server keeps these and publishes repr, bytes and error
    pickle_b64: Optional[str] = None
    outputs_b64: Optional[str] = None
    outputs_skipped: Optional[dict[str, Any]] = None


class Succeeded(Payload):
    seconds: Optional[float] = None


class Failed(Payload):
    error: str = ""


class Cancel(Payload):
    by: Optional[str] = None
    reason: str = ""


class CheckpointStarted(Payload):
    rank: int = 0
    step: Optional[int] = None
    reason: str = ""
    then: Optional[str] = None


class Checkpointed(Payload):
    rank: int = 0
    step: Optional[int] = None
    bytes: Optional[int] = None
    seconds: Optional[float] = None
    wait_s: Optional[float] = None
    path: Optional[str] = None
    store_path: Optional[str] = None
    #: with a store: the upload's seconds after the commit, the bytes it sent, and the bytes of
    #: unchanged blobs it copied within the store instead
    upload_s: Optional[float] = None
    upload_bytes: Optional[int] = None
    reused_bytes: Optional[int] = None
    #: what its exact continuation depends on (versions, device model): where it may resume
    fingerprint: Optional[dict[str, Any]] = None


class CheckpointFailed(Payload):
    error: Optional[str] = None
    variables: list[Any] = Field(default_factory=list)
    timeout: bool = False


class Preempting(Payload):
    reason: str = ""
    by: Optional[str] = None
    requeue: bool = False
    checkpoint_timeout: Optional[float] = None


class Preempted(Preempting):
    step: Optional[int] = None
    bytes: Optional[int] = None
    checkpoint: Optional[str] = None


class Resumed(Payload):
    rank: int = 0
    step: Optional[int] = None
    seconds: Optional[float] = None
    node: Optional[str] = None
    attempt: Optional[int] = None
    placement: list[Placement] = Field(default_factory=list)
    rebuilt: list[Any] = Field(default_factory=list)
    checkpoint: Optional[str] = None
    #: the restored checkpoint's number (the ranks of a job agree on it; ``step`` is this rank's own count)
    checkpoint_step: Optional[int] = None


class Migrating(Payload):
    from_: Optional[str] = Field(None, alias="from")
    to: Optional[str] = None
    reason: str = ""


class Migrated(Payload):
    from_: Optional[str] = Field(None, alias="from")
    to: Optional[str] = None
    step: Optional[int] = None
    seconds: Optional[float] = None


class Resizing(Payload):
    from_: Optional[int] = Field(None, alias="from")
    to: Optional[int] = None
    reason: str = ""
    by: Optional[str] = None


class Resized(Resizing):
    splicing: Optional[int] = None
    seconds: Optional[float] = None
    step: Optional[int] = None
    queued: bool = False
    phases: dict[str, float] = Field(default_factory=dict)


class NodeLost(Payload):
    node: Optional[str] = None
    silent_s: Optional[float] = None
    why: Optional[str] = None


class Retrying(Payload):
    attempt: Optional[int] = None
    why: str = ""
    retries: Optional[int] = None
    backoff_s: Optional[float] = None
    from_step: Optional[int] = None


class WorkerExited(Payload):
    rank: Optional[int] = None
    code: Optional[int] = None
    signal: Optional[Any] = None  # a signal's name, or its number when Python has no name for it
    node: Optional[str] = None
    error: Optional[str] = None
    stopped: Optional[str] = None
    planned_stop: Optional[str] = None
    user_error: bool = False  # the job's own code raised: retrying would raise again


class Interruptible(Payload):
    interruptible: Optional[bool] = None
    message: Optional[str] = None


class Exactness(Payload):
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)


class Superseded(Payload):
    attempt: Optional[int] = None
    ranks: Optional[list[int]] = None
    after_seq: Optional[int] = None
    before_seq: Optional[int] = None
    lines: Optional[int] = None


class Rendezvous(Payload):
    node: Optional[str] = None
    port: int = 0


#: the payload model of each event type
MODELS: dict[EventType, type[Payload]] = {
    EventType.SUBMITTED: Submitted, EventType.SCHEDULED: Scheduled, EventType.STARTED: Started,
    EventType.LOG: Log, EventType.PROGRESS: Progress, EventType.TELEMETRY: Payload, EventType.RESULT: Result,
    EventType.SUCCEEDED: Succeeded, EventType.FAILED: Failed, EventType.CANCEL_REQUESTED: Cancel,
    EventType.CANCELLED: Cancel, EventType.CHECKPOINT_STARTED: CheckpointStarted,
    EventType.CHECKPOINTED: Checkpointed, EventType.CHECKPOINT_FAILED: CheckpointFailed,
    EventType.PREEMPTING: Preempting, EventType.PREEMPTED: Preempted, EventType.RESUMED: Resumed,
    EventType.MIGRATING: Migrating, EventType.MIGRATED: Migrated, EventType.RESIZING: Resizing,
    EventType.RESIZED: Resized, EventType.NODE_LOST: NodeLost, EventType.RETRYING: Retrying,
    EventType.WORKER_EXITED: WorkerExited, EventType.INTERRUPTIBLE: Interruptible,
    EventType.EXACTNESS: Exactness, EventType.SUPERSEDED: Superseded,
    EventType.RENDEZVOUS: Rendezvous,
}


def decode(type: EventType, data: dict[str, Any], strict: bool = False) -> Any:
    """The typed view of one payload of ``type`` (pydantic's ValidationError, a ValueError, on a
    field of a wrong type). ``strict``: no conversions either (``"1"`` is not a rank), as the
    server reads what agents send. Typed ``Any`` so that callers read the fields of the event
    type they checked."""
    return MODELS[type].model_validate(data, strict=strict)


def of(ev: Event) -> Any:
    """The typed view of an event's data (pydantic's ValidationError on a field of a wrong type)."""
    return decode(ev.type, ev.data)
