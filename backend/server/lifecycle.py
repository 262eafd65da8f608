"""The job lifecycle's rules, as pure functions: no database, no network, no clock of their own.

A job's state (``JobState``) says where it is; while its workers are being stopped, ``Stop``
says why (the ``stop_reason`` column), and that decides what the job becomes once its last rank
has exited. Every rule of that kind lives here, reads a ``JobRecord`` (a job's row, decoded
once) and returns a ``Transition``: the columns to write, the events to emit, and the follow-ups
for the service to run after the transaction (stop the other ranks, place the job again, ...).
The service (agent_side.py, moves.py) applies transitions; tests/unit/test_lifecycle.py checks
every rule, state by state.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from backend.contract import EXIT_PREEMPTED
from singularity_sdk.payloads import Checkpointed
from singularity_sdk.protocol import EventType, JobState


class Stop(str, enum.Enum):
    """Why a job's workers are being stopped (stored as its value)."""

    CANCEL = "cancel"  # the user (or an admin) cancelled it
    FAILED = "failed"  # the user's code raised in a rank: the job fails
    CRASHED = "crashed"  # a rank's process died (not its code): retried from the newest checkpoint
    PREEMPT = "preempt"  # checkpoint and stop; PREEMPTED (or QUEUED again when ``requeue``)
    MIGRATE = "migrate"  # checkpoint and stop, then start elsewhere
    RESIZE = "resize"  # checkpoint and stop, then start on another number of devices


#: stops that a checkpoint must precede, and that a failed checkpoint calls off
MOVES = frozenset({Stop.PREEMPT, Stop.MIGRATE, Stop.RESIZE})
#: stops that end the job whatever its ranks do next
FINAL = frozenset({Stop.CANCEL, Stop.FAILED, Stop.CRASHED})
MOVE_STATES = {Stop.PREEMPT: JobState.PREEMPTING, Stop.MIGRATE: JobState.MIGRATING, Stop.RESIZE: JobState.RESIZING}


@dataclass(frozen=True)
class JobRecord:
    """The part of a job's row the lifecycle reads, with its JSON columns decoded."""

    id: str
    state: JobState
    ranks: int
    attempt: int = 1
    stop: Optional[Stop] = None
    stop_detail: dict[str, Any] = field(default_factory=dict)
    exited: dict[int, int] = field(default_factory=dict)
    error: Optional[str] = None
    retries: int = 0
    started_at: Optional[float] = None
    last_checkpoint: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Any) -> "JobRecord":
        return cls(id=row["id"], state=JobState(row["state"]), ranks=row["ranks"], attempt=row["attempt"],
                   stop=Stop(row["stop_reason"]) if row["stop_reason"] else None,
                   stop_detail=json.loads(row["stop_detail_json"] or "{}"),
                   exited={int(k): v for k, v in json.loads(row["exited_json"] or "{}").items()},
                   error=row["error"], retries=row["retries"], started_at=row["started_at"],
                   last_checkpoint=json.loads(row["last_checkpoint_json"] or "{}"))

    @property
    def checkpoint(self) -> Checkpointed:
        """The newest checkpoint, as its rank reported it (the ``checkpointed`` payload, whose
        types the server checks when it arrives)."""
        try:
            return Checkpointed.model_validate(self.last_checkpoint)
        except ValidationError:  # kept before the server checked payloads: its fields unknown
            return Checkpointed()


@dataclass(frozen=True)
class FollowUp:
    """Work for the service after the transaction: ``kind`` is one of
    ``stop_everywhere`` (``why``), ``migrate_onwards`` / ``resize_onwards`` (``detail``),
    ``wake_at`` (``when``) and ``schedule``."""

    kind: str
    why: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    when: float = 0.0


@dataclass
class Transition:
    updates: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[EventType, dict[str, Any]]] = field(default_factory=list)
    then: list[FollowUp] = field(default_factory=list)

    @property
    def state(self) -> Optional[JobState]:
        """The state the job moves to, if it moves."""
        value = self.updates.get("state")
        return JobState(value) if value is not None else None


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0


def on_rank_exit(job: JobRecord, rank: int, code: int, now: float, retry: RetryPolicy, *,
                 error: Optional[str] = None, user_error: bool = False, planned: Optional[str] = None) -> Transition:
    """One rank of a job that holds devices exited with ``code``. The first failure decides the
    job's fate (its code raised: FAILED; its process died: retried) and stops the other ranks;
    once every rank is down the job settles by why it stopped. Ranks that stopped at a
    checkpoint nobody here asked for (their node's planned stop, named by ``planned``, or a
    SIGTERM from outside) are queued again: the job resumes where it stopped."""
    if not 0 <= rank < job.ranks:
        raise ValueError(f"worker_exited needs an integer rank below {job.ranks} and an exit code")
    exited = {**job.exited, rank: code}
    t = Transition(updates={"exited_json": json.dumps({str(r): c for r, c in exited.items()})})
    stop, err = job.stop, job.error
    if code not in (0, EXIT_PREEMPTED) and stop not in FINAL:
        err = error or f"rank {rank} exited with code {code}"
        stop = Stop.FAILED if user_error else Stop.CRASHED
        t.updates.update(stop_reason=stop.value, error=err)
        t.then.append(FollowUp("stop_everywhere", why=f"rank {rank} {stop.value}"))
    if len(exited) < job.ranks:
        return t
    codes = set(exited.values())
    at_checkpoint = EXIT_PREEMPTED in codes and codes <= {0, EXIT_PREEMPTED}
    t.updates.update(stop_reason=None, stop_detail_json=None)
    if stop == Stop.CANCEL:
        _settle(t, JobState.CANCELLED, now, EventType.CANCELLED, {"reason": "workers stopped"})
    elif stop == Stop.FAILED:
        _settle(t, JobState.FAILED, now, EventType.FAILED, {"error": err})
    elif stop == Stop.CRASHED:
        settled = retry_or_fail(job, err or "", now, retry)
        t.updates.update(settled.updates)
        t.events += settled.events
        t.then += settled.then
    elif stop == Stop.PREEMPT and at_checkpoint:
        ckpt = job.checkpoint
        _settle(t, JobState.QUEUED if job.stop_detail.get("requeue") else JobState.PREEMPTED, now,
                EventType.PREEMPTED, {**job.stop_detail, "step": ckpt.step, "bytes": ckpt.bytes,
                                      "checkpoint": ckpt.path})
    elif stop is None and at_checkpoint:
        ckpt = job.checkpoint
        _settle(t, JobState.QUEUED, now, EventType.PREEMPTED, {
            "reason": planned or "the job was asked to stop (SIGTERM) and stopped at a checkpoint",
            "by": "node", "requeue": True, "step": ckpt.step, "bytes": ckpt.bytes,
            "checkpoint": ckpt.path})
    elif stop == Stop.MIGRATE and at_checkpoint:
        t.then.append(FollowUp("migrate_onwards", detail=job.stop_detail))
    elif stop == Stop.RESIZE and at_checkpoint:
        t.then.append(FollowUp("resize_onwards", detail=job.stop_detail))
    else:  # every rank finished (a move whose checkpoint the job outran ends the same way)
        _settle(t, JobState.SUCCEEDED, now, EventType.SUCCEEDED, {"seconds": round(now - (job.started_at or now), 3)})
    t.then.append(FollowUp("schedule"))
    return t


def retry_or_fail(job: JobRecord, why: str, now: float, retry: RetryPolicy) -> Transition:
    """Requeue a job whose processes died (not its code), with backoff, from its newest
    checkpoint; FAILED once it has been retried ``max_retries`` times."""
    t = Transition()
    retries = job.retries + 1
    if retries > retry.max_retries:
        err = f"{why}\n(gave up after {job.retries} retries)"
        t.updates.update(error=err)
        _settle(t, JobState.FAILED, now, EventType.FAILED, {"error": err})
        return t
    delay = min(retry.backoff_s * 2 ** (retries - 1), retry.max_backoff_s)
    t.updates.update(state=JobState.QUEUED.value, retries=retries, stop_reason=None, exited_json="{}",
                     not_before=now + delay, error=None)
    t.events.append((EventType.RETRYING, {"attempt": job.attempt + 1,
                                          "why": why.strip().splitlines()[-1] if why else "",
                                          "retries": retries, "backoff_s": delay,
                                          "from_step": job.checkpoint.step}))
    t.then.append(FollowUp("wake_at", when=now + delay))
    return t


def on_workers_lost(job: JobRecord, why: str, now: float, retry: RetryPolicy) -> Transition:
    """The job's workers vanished without reporting an exit (their node or agent is gone)."""
    if job.stop == Stop.CANCEL:
        t = Transition(updates={"stop_reason": None})
        _settle(t, JobState.CANCELLED, now, EventType.CANCELLED, {"reason": why})
    else:
        t = retry_or_fail(job, why, now, retry)
    t.then.append(FollowUp("schedule"))
    return t


def move_called_off(job: JobRecord) -> dict[str, Any]:
    """A preempt, migrate or resize whose checkpoint failed (or never came): the job runs on,
    at its old size. Returns the columns to write; ``{}`` when no move is under way."""
    if job.stop not in MOVES:
        return {}
    updates: dict[str, Any] = {"state": JobState.RUNNING.value, "stop_reason": None, "stop_detail_json": None}
    if "request_was" in job.stop_detail:
        updates["gpus"] = job.stop_detail["request_was"]
    return updates


def on_cancel(job: JobRecord, now: float, data: dict[str, Any]) -> Transition:
    """Cancel: a job without workers ends at once; one with workers is CANCELLED once they are
    down (a preemption under way is overtaken: the job counts as RUNNING until then)."""
    if job.state.is_terminal:
        raise ValueError(f"job {job.id} already {job.state.value}; nothing to cancel")
    t = Transition()
    if not job.state.holds_devices:
        _settle(t, JobState.CANCELLED, now, EventType.CANCELLED, data)
        t.then.append(FollowUp("schedule"))
    elif job.stop != Stop.CANCEL:
        t.updates.update(stop_reason=Stop.CANCEL.value,
                         state=(JobState.RUNNING if job.state == JobState.PREEMPTING else job.state).value)
        t.events.append((EventType.CANCEL_REQUESTED, data))
        t.then.append(FollowUp("stop_everywhere", why="cancelled"))
    else:
        t.then.append(FollowUp("stop_everywhere", why="cancelled"))
    return t


def _settle(t: Transition, state: JobState, now: float, etype: EventType, data: dict[str, Any]) -> None:
    t.updates["state"] = state.value
    if state.is_terminal:
        t.updates["ended_at"] = now
    t.events.append((etype, data))
