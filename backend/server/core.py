"""What every part of the service shares: its configuration, its error type, and the handle on
a connected agent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from pydantic import BaseModel


class ServiceError(Exception):
    """An error a client caused, with the HTTP status and the field it concerns."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


class AgentLink(Protocol):
    """The server's handle on one connected agent (a WebSocket in production)."""

    node: str

    def send(self, message: BaseModel) -> None: ...

    def close(self, code: Optional[int] = None, reason: Optional[str] = None) -> None: ...


@dataclass
class ServiceConfig:
    heartbeat_s: float = 1.0
    node_timeout_s: float = 10.0
    #: a node whose agent's connection broke without a close (its process died) and that has not
    #: reconnected this long is lost at once, without waiting for node_timeout_s
    drop_grace_s: float = 2.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    stop_grace_s: float = 1.0
    #: cluster default for jobs that do not set checkpoint_every (None: only on request); a node
    #: that dies then costs minutes of work, and a one-rank job pays only an in-memory snapshot
    #: per checkpoint (it is written behind the loop, see backend/proxy/background.py)
    checkpoint_every: Optional[float] = 600.0
    #: how long a preempt/migrate/resize/checkpoint may wait for a safe point before the job
    #: answers checkpoint_failed (saying where it is) and runs on; a request may set its own
    checkpoint_timeout_s: float = 60.0
    #: the scheduling policy: "singularity" (tiers, preemption, defragmentation) or "fifo"
    policy: str = "singularity"
    #: a job preempted or moved less than this long ago is not moved again (anti-thrash)
    min_move_interval_s: float = 60.0
    #: what the policy assumes one preemption or migration costs (seconds of a job's devices):
    #: a defragmenting move happens only when its expected gain beats twice this
    move_cost_s: float = 5.0
