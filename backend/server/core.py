"""What every part of the service shares: its configuration, its error type, the handle on a
connected agent, the shared state and plumbing (`Core`), and the narrow interfaces through which
the parts reach each other (`Rounds`, `Movers`, `Losses`, `Quotas`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from pydantic import BaseModel

from singularity_sdk.protocol import Event, EventType, JobInfo, JobState, NodeInfo, NodeState, StopJob

from .hub import Hub
from .store import Store

if TYPE_CHECKING:
    from backend.scheduler.types import Snapshot

log = logging.getLogger("singularity.server")
#: What a user sees in ``nodes`` for a device held by another user's job.
OTHER_JOB = "(other)"


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
    #: per checkpoint (it is written behind the loop, see backend/proxy/engine/background.py)
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
    #: user -> the OS account their jobs run as (serve --run-as; backend/agent/accounts.py);
    #: None: every job runs as the agents' own user. A user missing from it cannot submit
    run_as: Optional[dict[str, str]] = None


class Core:
    """The service's shared state and plumbing, given to each of its parts (agent side, moves,
    scheduling, usage), which do not inherit from each other: the store, the config, the event
    hub, the agents' connections and what they said in their hellos, and emit / publish / send."""

    def __init__(self, store: Store, config: ServiceConfig) -> None:
        self.store = store
        self.config = config
        self.hub = Hub()
        self.links: dict[str, AgentLink] = {}
        #: node -> when its agent's connection broke without a close frame (see check_nodes)
        self.dropped: dict[str, float] = {}
        #: node -> what a resumed job's result depends on there (versions, device model), from its hello
        self.fingerprints: dict[str, dict[str, Any]] = {}
        #: node -> the Ray node its agent was placed on (serve --ray fills it in)
        self.ray_node_ids: dict[str, str] = {}
        #: run a scheduling round (soon); the asyncio layer coalesces many calls into one round
        self.schedule: Callable[[], None] = lambda: None
        #: run one at a given time (when a retry's backoff ends)
        self.wake_at: Callable[[float], None] = lambda when: None

    def emit(self, job_id: str, type: EventType, data: dict[str, Any], when: Optional[float] = None) -> Event:
        """Append an event inside the caller's transaction; `publish` it after the commit."""
        return self.store.append_event(job_id, type, data, when)

    def publish(self, user: str, events: list[Event]) -> None:
        if events:
            self.hub.publish(user, events)

    def send(self, node: str, message: BaseModel) -> bool:
        link = self.links.get(node)
        if link is None:
            return False
        try:
            link.send(message)
            return True
        except Exception as exc:  # a dying socket must not break the caller's transaction
            log.warning("could not send %s to %s: %s", type(message).__name__, node, exc)
            return False

    def job(self, user: str, job_id: str) -> JobInfo:
        info = self.store.job_info(job_id)
        if info is None or info.user != user:
            raise ServiceError(
                404, f"no job '{job_id}' among {user}'s jobs; 'singularityctl jobs' lists them", "job_id"
            )
        return info

    def stop_everywhere(self, info: JobInfo, reason: str) -> None:
        for p in info.placement:
            self.send(p.node, StopJob(job_id=info.id, attempt=info.attempt, reason=reason,
                                      grace_s=self.config.stop_grace_s))

    def capacity(self) -> int:
        return sum(len(n.devices) for n in self.store.nodes() if n.state != NodeState.DOWN)

    def nodes(self, user: Optional[str] = None) -> list[NodeInfo]:
        """The cluster's nodes; a device held by someone else's job shows as ``"(other)"`` unless
        ``user`` is None (the admin), so job ids do not leak across users."""
        used: dict[str, dict[int, str]] = {}
        for info in self.store.list_jobs(states=[s.value for s in JobState if s.holds_devices]):
            for p in info.placement:
                for d in p.devices:
                    used.setdefault(p.node, {})[d] = info.id if user in (None, info.user) else OTHER_JOB
        out = []
        for n in self.store.nodes():
            n.used = used.get(n.name, {})
            n.ray_node_id = self.ray_node_ids.get(n.name)
            out.append(n)
        return out


class Rounds(Protocol):
    """What moves need of scheduling."""

    def snapshot(self) -> "Snapshot": ...

    def start_attempt(self, row: Any, placement: dict[str, tuple[int, ...]], reason: str, state: JobState) -> None: ...


class Movers(Protocol):
    """What scheduling and the agent side need of moves."""

    def preempt(self, user: str, job_id: str, reason: str = "", by: Optional[str] = None,
                requeue: bool = False, checkpoint_timeout: Optional[float] = None) -> JobInfo: ...

    def migrate(self, user: str, job_id: str, to: Optional[str] = None, reason: str = "",
                by: Optional[str] = None, checkpoint_timeout: Optional[float] = None) -> JobInfo: ...

    def resize(self, user: str, job_id: str, gpus: Optional[int], reason: str = "", by: Optional[str] = None,
               placement: Optional[dict[str, tuple[int, ...]]] = None,
               checkpoint_timeout: Optional[float] = None) -> JobInfo: ...

    def migrate_onwards(self, job_id: str, detail: dict[str, Any]) -> None: ...

    def resize_onwards(self, job_id: str, detail: dict[str, Any]) -> None: ...


class Losses(Protocol):
    """What scheduling needs of the agent side: a start that cannot reach its node loses the attempt."""

    def job_lost(self, info: JobInfo, why: str) -> None: ...


class Starts(Protocol):
    """What the agent side needs of scheduling: the rest of an attempt's starts, once rank 0's
    node chose the rendezvous port."""

    def rendezvous_chosen(self, job_id: str, attempt: int, port: int) -> None: ...


class Quotas(Protocol):
    """What scheduling needs of usage: the quotas the snapshot carries."""

    def quotas(self) -> dict[tuple[str, str], int]: ...
