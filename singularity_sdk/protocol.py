"""The wire protocol: every message the SDK, the server and the node agents exchange.

Both sides import these models, so a field renamed here is renamed everywhere. Every model
forbids unknown fields: a typo in a client is reported as a 4xx naming the field instead of
being silently ignored.
"""
from __future__ import annotations

import enum
import keyword
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from .folders import MAX_WORKDIR_BYTES  # noqa: F401  (the largest synced copy of a job's folder)

PROTOCOL_VERSION = 1
API_PREFIX = "/api/v1"

#: Largest source or pickled callable a job may carry. Data belongs in files the job reads.
MAX_CODE_BYTES = 4 * 1024 * 1024
#: Largest pickled result the server keeps for ``job.result()``.
MAX_RESULT_BYTES = 32 * 1024 * 1024
#: Largest pickled set of notebook variables sent with a job (``inputs_b64``).
MAX_INPUTS_BYTES = 64 * 1024 * 1024
#: Most command-line arguments a job may carry (``sys.argv[1:]``), and their total size.
MAX_ARGS = 4096
MAX_ARGS_BYTES = 256 * 1024
#: Most ranks a job may time-share one device with (replica splicing beyond this only thrashes).
MAX_RANKS_PER_DEVICE = 16
#: Most variables a job may return, and most environment variables it may set.
MAX_OUTPUTS = 256
MAX_ENV = 256
#: An environment variable's name: what a shell accepts (no '=', no NUL, no spaces).
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Largest agent sequence number or attempt (SQLite integers are 64-bit).
MAX_SEQ = 2**62


class JobState(str, enum.Enum):
    """Where a job is in its life. Only the last three are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTING = "preempting"
    PREEMPTED = "preempted"
    MIGRATING = "migrating"
    RESIZING = "resizing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def holds_devices(self) -> bool:
        """True while the job's workers may be alive on their devices."""
        return self in (JobState.RUNNING, JobState.PREEMPTING, JobState.MIGRATING, JobState.RESIZING)

    def __str__(self) -> str:
        return self.value


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class SLA(str, enum.Enum):
    """Service tiers: how much a job may be shrunk or preempted for others."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BASIC = "basic"

    def __str__(self) -> str:
        return self.value


class EventType(str, enum.Enum):
    """Every kind of entry in a job's append-only event log.

    Some are emitted by later features (checkpointing, migration, resize); they are listed
    here so that every consumer (CLI, widget) can render them from day one.
    """

    SUBMITTED = "submitted"
    SCHEDULED = "scheduled"
    STARTED = "started"
    LOG = "log"
    PROGRESS = "progress"
    TELEMETRY = "telemetry"
    RESULT = "result"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCEL_REQUESTED = "cancel_requested"
    CANCELLED = "cancelled"
    CHECKPOINT_STARTED = "checkpoint_started"
    CHECKPOINTED = "checkpointed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    PREEMPTING = "preempting"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    MIGRATING = "migrating"
    MIGRATED = "migrated"
    RESIZING = "resizing"
    RESIZED = "resized"
    NODE_LOST = "node_lost"
    RETRYING = "retrying"
    WORKER_EXITED = "worker_exited"
    #: at start: whether and where the job can be interrupted (its safe points), or why not
    INTERRUPTIBLE = "interruptible"
    #: what an exact resume depends on (versions, device, settings), and warnings about it
    EXACTNESS = "exactness"
    #: log lines of a dead attempt that the re-executed steps print again (backend/server/log_replay.py)
    SUPERSEDED = "superseded"
    #: rank 0's node chose the port of the job's rendezvous (jobs whose ranks span nodes: the
    #: other nodes start their ranks once they know it)
    RENDEZVOUS = "rendezvous"

    def __str__(self) -> str:
        return self.value


class Strict(BaseModel):
    """Base of every wire model: unknown fields are errors, values are validated."""

    model_config = ConfigDict(extra="forbid", frozen=False, use_enum_values=False)


# --------------------------------------------------------------------------- REST bodies


class SubmitRequest(Strict):
    """``POST /api/v1/jobs``. Exactly one of ``source`` and ``callable_b64`` is given."""

    source: Optional[str] = Field(None, description="Python source: a cell or a script")
    callable_b64: Optional[str] = Field(
        None, description="base64 of cloudpickle.dumps((fn, args, kwargs))"
    )
    filename: str = Field("<cell>", max_length=512, description="shown in tracebacks")
    inputs_b64: Optional[str] = Field(
        None, description="base64 of cloudpickle.dumps({name: value}): variables the code starts with"
    )
    outputs: list[str] = Field(
        default_factory=list, description="names whose final values come back (job.outputs())"
    )
    name: Optional[str] = Field(None, max_length=128)
    gpus: int = Field(1, ge=1, le=4096, description="devices requested (logical world size)")
    ranks: Optional[int] = Field(None, ge=1, le=4096, description="processes; default one per device")
    sla: SLA = SLA.STANDARD
    checkpoint_every: Optional[float] = Field(None, gt=0, description="seconds between checkpoints")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the workers")
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS,
                            description="the script's command-line arguments: sys.argv is [filename, *args]")
    workdir: Optional[str] = Field(None, max_length=4096, description="absolute path of the folder the job "
                                   "was submitted from: its working directory wherever the node sees it")
    workdir_b64: Optional[str] = Field(None, description="base64 of a gzip'd tar of that folder: the copy a node "
                                       "that does not see the folder runs in (at most MAX_WORKDIR_BYTES of files)")


    @field_validator("args", mode="before")
    @classmethod
    def _args_are_strings(cls, value: Any) -> Any:
        """argv holds strings only: say so plainly instead of pydantic's per-item wording."""
        if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
            raise ValueError('must be a list of strings, like ["--lr", "0.1"] (convert numbers with str())')
        if sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in value) > MAX_ARGS_BYTES:
            raise ValueError(f"the arguments exceed {MAX_ARGS_BYTES // 1024} KiB in all; "
                             f"put long inputs in a file the job reads")
        return list(value)

    @field_validator("outputs")
    @classmethod
    def _outputs_are_names(cls, value: list[str]) -> list[str]:
        """Outputs are variable names, nothing that could be read as a path."""
        if len(value) > MAX_OUTPUTS:
            raise ValueError(f"at most {MAX_OUTPUTS} names")
        for name in value:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise ValueError(f"{name!r} is not a Python variable name; list the names of variables "
                                 f"the job leaves behind, like [\"model\", \"losses\"]")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Refused here rather than by the worker's exec, which would burn the job's retries."""
        if len(value) > MAX_ENV:
            raise ValueError(f"at most {MAX_ENV} variables")
        for name in value:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and '_', "
                                 f"not starting with a digit)")
        return value


class JobAction(Strict):
    """``POST /api/v1/jobs/{id}/{action}`` bodies (all fields optional)."""

    reason: Optional[str] = Field(None, max_length=500)
    node: Optional[str] = None
    gpus: Optional[int] = Field(None, ge=1)
    checkpoint_timeout: Optional[float] = Field(None, gt=0, le=86400, description=(
        "seconds the job may take to reach a safe point (preempt, migrate, resize, checkpoint); "
        "then it answers checkpoint_failed saying where it is, and runs on. Default: the server's"))


class CreateUserRequest(Strict):
    """``POST /api/v1/users`` (admin only): issue a token for a new user."""

    user: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")


class QuotaRequest(Strict):
    """``POST /api/v1/quotas`` (admin only): at most ``devices`` of ``tier`` for ``user`` (null: no limit)."""

    user: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    tier: SLA
    devices: Optional[int] = Field(None, ge=0, le=1_000_000)


# --------------------------------------------------------------------------- read models


class Placement(Strict):
    """Where a job's ranks run: for each node, the device indices it holds there."""

    node: str
    devices: list[int]
    ranks: list[int] = Field(default_factory=list)


class JobInfo(Strict):
    id: str
    name: str
    user: str
    state: JobState
    sla: SLA
    gpus: int
    ranks: int
    placement: list[Placement] = Field(default_factory=list)
    attempt: int = 0
    created_at: float
    updated_at: float
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    error: Optional[str] = None
    has_result: bool = False
    last_seq: int = 0
    checkpoint_every: Optional[float] = None
    filename: str = "<cell>"


class Event(Strict):
    job_id: str
    seq: int
    type: EventType
    time: float
    data: dict[str, Any] = Field(default_factory=dict)

    @property
    def lines(self) -> list[str]:
        """A ``log`` event's lines, each with its newline (lines printed in a burst travel as
        one event); ``[]`` for other events."""
        return log_lines(self.data.get("line", "")) if self.type is EventType.LOG else []


def log_lines(text: Any) -> list[str]:
    """The lines of a ``log`` event's ``line``, each with its newline. The lines a rank printed
    in a burst reach its agent together and travel as one event (one row, one frame for all
    followers), so a chatty job costs per burst, not per line. A piece of an over-long line has
    no newline."""
    if not isinstance(text, str):
        return [""]
    if text.find("\n") in (-1, len(text) - 1):
        return [text]
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


class DeviceInfo(Strict):
    index: int
    kind: Literal["cuda", "cpu"]
    name: str
    uuid: Optional[str] = None
    memory_bytes: Optional[int] = None


class NodeState(str, enum.Enum):
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"
    DOWN = "down"

    def __str__(self) -> str:
        return self.value


class NodeInfo(Strict):
    name: str
    state: NodeState
    devices: list[DeviceInfo]
    used: dict[int, str] = Field(default_factory=dict, description="device index -> job id")
    heartbeat_at: Optional[float] = None
    address: Optional[str] = None
    ray_node_id: Optional[str] = Field(None, description="the Ray node its agent runs on (serve --ray)")


class ResultPayload(Strict):
    """``GET /api/v1/jobs/{id}/result``: the pickled value and its repr for display."""

    job_id: str
    pickle_b64: Optional[str] = None
    repr: str = ""
    error: Optional[str] = None
    #: base64 of cloudpickle.dumps({name: value}) for the names the job was asked to return
    outputs_b64: Optional[str] = None
    #: names that were asked for but could not come back, with why
    outputs_skipped: dict[str, str] = Field(default_factory=dict)


class ErrorBody(Strict):
    error: str
    field: Optional[str] = None


# --------------------------------------------------------------------------- agent channel
# Agent -> server messages carry ``type``; the server answers ``ack`` for events.


class AgentHello(Strict):
    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    node: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    instance: str = Field(..., description="unique per agent process: fences replayed events")
    devices: list[DeviceInfo]
    #: (job id, attempt) of every job whose workers are alive or whose exit is not yet acked
    known_jobs: list[tuple[str, int]] = Field(default_factory=list)
    acked_seq: int = 0
    address: Optional[str] = Field(None, max_length=255, description="how the other nodes reach this one: "
                                   "MASTER_ADDR of jobs whose rank 0 runs here")
    #: what an exact resume depends on here: python/torch/numpy versions and the device model
    #: (a job with a checkpoint is placed only where its checkpoint's fingerprint matches)
    fingerprint: dict[str, Optional[str]] = Field(default_factory=dict)


class AgentEvent(Strict):
    """One event produced on a node. ``agent_seq`` is per agent instance and makes replay
    idempotent: the server commits the highest applied value with the event itself."""

    agent_seq: int = Field(..., ge=1, le=MAX_SEQ)
    job_id: str = Field(..., max_length=64)
    attempt: int = Field(..., ge=0, le=MAX_SEQ)
    type: EventType
    time: float = Field(..., allow_inf_nan=False)
    data: dict[str, Any] = Field(default_factory=dict)


class AgentEvents(Strict):
    type: Literal["events"] = "events"
    events: list[AgentEvent]


class AgentHeartbeat(Strict):
    type: Literal["heartbeat"] = "heartbeat"
    time: float
    running: list[tuple[str, int]] = Field(default_factory=list)


class AgentLeaving(Strict):
    """Agent -> server: a planned stop has begun; place nothing more on this node (its jobs
    checkpoint and stop, and are queued again). A later hello makes the node ready again."""

    type: Literal["leaving"] = "leaving"
    reason: str = Field("", max_length=1000)


AgentMessage = Union[AgentHello, AgentEvents, AgentHeartbeat, AgentLeaving]
agent_message_adapter: TypeAdapter[AgentMessage] = TypeAdapter(
    Union[AgentHello, AgentEvents, AgentHeartbeat, AgentLeaving]
)


class RankSpec(Strict):
    rank: int
    local_rank: int
    devices: list[int]


class StartJob(Strict):
    """Server -> agent: start the workers of one attempt of a job."""

    type: Literal["start"] = "start"
    job_id: str
    attempt: int
    world_size: int
    local_world_size: int
    ranks: list[RankSpec]
    master_addr: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535, description="0: this node hosts the job's rendezvous and picks "
                                                           "a free port itself (announced with a rendezvous "
                                                           "event when ranks run on other nodes too)")
    source: Optional[str] = None
    callable_b64: Optional[str] = None
    filename: str = "<cell>"
    inputs_b64: Optional[str] = None
    outputs: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    workdir: Optional[str] = None
    workdir_b64: Optional[str] = None
    restore: bool = Field(False, description="resume from the newest usable checkpoint of the job (its store "
                                             "picks it, so a damaged newest one falls back to the one before)")
    restore_step: Optional[int] = Field(None, description="with restore: the step of the newest checkpoint the "
                                                          "server heard of; newer ones (written by an attempt whose "
                                                          "report never arrived) are removed, not restored")
    checkpoint_every: Optional[float] = None
    layout: Optional[str] = Field(None, description="jobs of several ranks: the logical ranks of each device "
                                                    "slot, in physical order, e.g. '0,1|2,3' (two ranks per device)")
    run_as: Optional[str] = Field(None, description="the OS account the job's workers run as (serve --run-as); "
                                                    "None: the agent's own")


class StopJob(Strict):
    """Server -> agent: stop a job's workers (SIGTERM, then SIGKILL after ``grace_s``)."""

    type: Literal["stop"] = "stop"
    job_id: str
    attempt: int
    reason: str = "cancelled"
    grace_s: float = 1.0


class CheckpointJob(Strict):
    """Server -> agent: take a checkpoint at the next safe point; ``then`` says what follows."""

    type: Literal["checkpoint"] = "checkpoint"
    job_id: str
    attempt: int
    then: Literal["continue", "stop"] = "continue"
    reason: str = ""
    #: no safe point by then: the rank drops the request and answers checkpoint_failed
    timeout_s: Optional[float] = None


class PrefetchCheckpoint(Strict):
    """Server -> agent: a job is migrating here; follow the checkpoint that ``attempt`` (the
    source's) is writing into the store and copy it while it arrives (backend/agent/prefetch.py).
    Only a hint: the start that follows restores whatever the server names. ``cancel``: the
    migration was called off or went elsewhere; stop and drop the copy."""

    type: Literal["prefetch"] = "prefetch"
    job_id: str
    attempt: int
    cancel: bool = False


class Ack(Strict):
    type: Literal["ack"] = "ack"
    agent_seq: int


class Welcome(Strict):
    type: Literal["welcome"] = "welcome"
    protocol: int = PROTOCOL_VERSION
    acked_seq: int
    heartbeat_s: float


class Shutdown(Strict):
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


ServerToAgent = Union[StartJob, StopJob, CheckpointJob, PrefetchCheckpoint, Ack, Welcome, Shutdown]
server_message_adapter: TypeAdapter[ServerToAgent] = TypeAdapter(ServerToAgent)


def describe_validation_error(exc: ValidationError) -> tuple[str, Optional[str]]:
    """Turn pydantic's error list into one sentence that names the offending field."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("function-after",))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unknown field '{loc}'"
    elif kind == "missing":
        msg = f"missing field '{loc}'"
    else:
        text = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        msg = f"field '{loc}': {text}"
    more = len(exc.errors()) - 1
    if more:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return msg, loc or None
