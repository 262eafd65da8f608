"""The scheduler's view of the world: an immutable snapshot in, a list of actions out.

Policies are pure functions over these types, so the same code runs inside the server and in
the trace simulator, and can be unit-tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from singularity_sdk.protocol import SLA, JobState


@dataclass(frozen=True)
class NodeView:
    name: str
    devices: tuple[int, ...]
    #: device index -> id of the job holding it
    used: dict[int, str] = field(default_factory=dict)
    schedulable: bool = True  # False while draining, lost or down

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(d for d in self.devices if d not in self.used)


@dataclass(frozen=True)
class JobView:
    id: str
    user: str
    sla: SLA
    state: JobState
    gpus: int  # devices requested; the sizes it may run at are divisors of it
    submitted_at: float
    #: node -> device indices currently held (empty when not placed)
    placement: dict[str, tuple[int, ...]] = field(default_factory=dict)
    last_checkpoint_at: Optional[float] = None
    last_moved_at: Optional[float] = None
    #: whether it may run on fewer devices than ``gpus`` (a divisor of it); jobs whose ranks
    #: each use several devices, or that have one rank, run at full size only
    elastic: bool = True
    #: attained service: device-seconds the job has held devices so far, over all its runs, up
    #: to the snapshot's ``now`` (held x seconds, stalls included; 0 for a job that never ran).
    #: The policy ranks jobs of one tier by it (least attained service first); left at 0 for
    #: every job, it falls back to fair share and FIFO and takes nothing for same-tier work
    attained_s: float = 0.0
    #: seconds the job has held devices so far (wall clock, over all its runs, up to ``now``;
    #: 0 for a job that never ran): ``now - submitted_at - ran_s`` is how long it has waited.
    #: None (unknown): basic jobs age with their time in the system, and a waiting job's wait
    #: counts from its last preemption (``last_moved_at``), else from its submission
    ran_s: Optional[float] = None
    #: the only nodes it may run on (None: any): those where its checkpoint resumes exactly
    #: (same python/torch/numpy versions and device model as the checkpoint recorded)
    nodes: Optional[frozenset[str]] = None

    @property
    def placed_devices(self) -> int:
        return sum(len(d) for d in self.placement.values())


@dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]
    #: (user, tier) -> most devices the user's jobs of that tier may hold at that tier; a job
    #: beyond it runs one tier down (``quotas.py``). Absent: unlimited
    quotas: dict[tuple[str, str], int] = field(default_factory=dict)

    def queued(self) -> list[JobView]:
        """Jobs waiting for devices, oldest first."""
        waiting = [j for j in self.jobs if j.state == JobState.QUEUED]
        return sorted(waiting, key=lambda j: (j.submitted_at, j.id))


@dataclass(frozen=True)
class Place:
    """Start (or resume) ``job_id`` on these devices; all ranks at once (gang)."""

    job_id: str
    placement: dict[str, tuple[int, ...]]
    reason: str = ""


@dataclass(frozen=True)
class Preempt:
    job_id: str
    reason: str = ""


@dataclass(frozen=True)
class Migrate:
    job_id: str
    placement: dict[str, tuple[int, ...]]
    reason: str = ""


@dataclass(frozen=True)
class Resize:
    job_id: str
    placement: dict[str, tuple[int, ...]]
    reason: str = ""


Action = Union[Place, Preempt, Migrate, Resize]
