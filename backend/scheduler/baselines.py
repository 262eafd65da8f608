"""Baseline policies, same interface as the Singularity policy: ``policy(snapshot) -> actions``.

- ``fifo``: FIFO gang scheduling without preemption; the head of the queue blocks the rest.
- ``fifo-backfill``: FIFO with first-fit backfill (not EASY): any waiting job that fits now
  starts, in FIFO order, with no reservation for the head; large jobs can wait long.
- ``tiresias``: Tiresias' discretised two-dimensional LAS (Gu et al., NSDI'19): priority by
  attained service (devices x seconds held), in discrete queues, FIFO by arrival inside a
  queue; preemptive; each preemption costs the simulator's overhead like any other move.
- ``srtf``: an oracle, preemptive shortest-remaining-time-first (remaining run time at full
  size, as a simulator knows it): a reference point, not a deployable policy.
- ``srtf-premium``: the same oracle serving premium work first (premium jobs by remaining time
  among themselves, then everyone else by remaining time): what a scheduler that knew every
  job's duration could give standard and basic work while keeping premium's promise. A bound
  to read the Singularity policy's misses against, not a policy.  Premium jobs are never
  preempted (running premium jobs rank first, waiting ones next, oldest first).

All use the shared locality rule of ``placement.py``, run jobs at full size only, and never
resize or migrate. Tiresias and SRTF need per-job numbers the snapshot does not carry; they
take a lookup function (job id -> seconds) from whoever runs them: the simulator passes its own.
"""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from typing import Callable, Sequence

from singularity_sdk.protocol import SLA, JobState

from .placement import FreeDevices, fmt_placement
from .round_state import HOLDING, WAITING
from .types import Action, JobView, Place, Preempt, Snapshot

Lookup = Callable[[str], float]


def _waiting_fifo(snapshot: Snapshot) -> list[JobView]:
    """Queued and preempted jobs, oldest submission first."""
    waiting = [j for j in snapshot.jobs if j.state in WAITING]
    waiting.sort(key=lambda j: (j.submitted_at, j.id))
    return waiting


def _place(job: JobView, free: FreeDevices, why: str) -> Place | None:
    placement = free.pick(job.gpus)
    if placement is None:
        return None
    free.take_placement(placement)
    return Place(job.id, placement, reason=f"{why}; placed on {fmt_placement(placement)}")


def fifo_gang_policy(snapshot: Snapshot) -> list[Action]:
    """Strict FIFO, all ranks at once: nothing overtakes the head of the queue."""
    free = FreeDevices(snapshot.nodes)
    actions: list[Action] = []
    for job in _waiting_fifo(snapshot):
        act = _place(job, free, "fifo: first in queue")
        if act is None:
            break
        actions.append(act)
    return actions


def fifo_backfill_policy(snapshot: Snapshot) -> list[Action]:
    """FIFO with first-fit backfill: every waiting job that fits starts, in FIFO order."""
    free = FreeDevices(snapshot.nodes)
    actions: list[Action] = []
    blocked = False
    for job in _waiting_fifo(snapshot):
        if free.total == 0:
            break
        act = _place(job, free, "fifo-backfill: fits now" + (" (backfilled past a waiting job)" if blocked else ""))
        if act is None:
            blocked = True
            continue
        actions.append(act)
    return actions


class PriorityPreemptivePolicy(ABC):
    """Preemptive gang scheduling by a priority key (lower first), full size only.

    Each round: walk all jobs by priority and admit a job when its W still fits in the
    cluster's device count; admitted waiting jobs are placed on free devices first, then on
    devices of running jobs that were not admitted, which are preempted only if a device of
    theirs is actually used; finally any waiting job that fits on what is left starts
    (work-conserving).
    """

    name = "priority"

    @abstractmethod
    def key(self, job: JobView) -> tuple:
        """Sort key: lower runs first."""

    @abstractmethod
    def describe(self, job: JobView) -> str:
        """The job's priority in words, for reasons."""

    def __call__(self, snapshot: Snapshot) -> list[Action]:
        free = FreeDevices(snapshot.nodes)
        running: list[JobView] = []
        waiting: list[JobView] = []
        fixed = 0
        for j in snapshot.jobs:
            if j.state in WAITING:
                waiting.append(j)
            elif j.state == JobState.RUNNING:
                running.append(j)
            elif j.state in HOLDING:
                fixed += j.placed_devices
        if not waiting:
            return []
        keys = {j.id: self.key(j) for j in running}
        keys.update((j.id, self.key(j)) for j in waiting)
        order = sorted(running + waiting, key=lambda j: keys[j.id])
        budget = free.capacity - fixed
        admitted: set[str] = set()
        for j in order:
            if j.gpus <= budget:
                admitted.add(j.id)
                budget -= j.gpus
        actions: list[Action] = []
        todo = [j for j in order if j.id in admitted and j.state in WAITING]
        todo = self._place_all(todo, free, actions, "admitted by priority")
        losers = [j for j in order if j.state == JobState.RUNNING and j.id not in admitted]
        if todo and losers:
            for j in losers:
                free.give_placement(j.placement)
            mark = len(actions)
            self._place_all(todo, free, actions, "admitted by priority")
            owner = {(n, d): a.job_id for a in actions[mark:] for n, devs in a.placement.items() for d in devs}  # type: ignore[union-attr]
            preempts: list[Action] = []
            for j in losers:
                winner = next((owner[(n, d)] for n, devs in j.placement.items() for d in devs if (n, d) in owner), None)
                if winner is None:
                    free.take_placement(j.placement)  # none of its devices were needed: keeps running
                else:
                    preempts.append(
                        Preempt(j.id, reason=f"preempted: {self.name} ranks {winner} higher ({self.describe(j)})")
                    )
            actions[mark:mark] = preempts
        placed = {a.job_id for a in actions}
        rest = [j for j in order if j.state in WAITING and j.id not in placed]
        self._place_all(rest, free, actions, "backfilled into idle devices")
        return actions

    def _place_all(self, jobs: Sequence[JobView], free: FreeDevices, actions: list[Action], why: str) -> list[JobView]:
        """Place what fits, in order; return the jobs that did not fit."""
        left = []
        for j in jobs:
            act = _place(j, free, f"{self.name}: {why} ({self.describe(j)})") if free.total else None
            if act is None:
                left.append(j)
            else:
                actions.append(act)
        return left


class TiresiasPolicy(PriorityPreemptivePolicy):
    """Discretised 2D-LAS: queue index by attained device-seconds, FIFO by arrival inside."""

    name = "tiresias"

    def __init__(self, attained: Lookup, thresholds_gpu_s: Sequence[float] = (3600.0, 36000.0)):
        self.attained = attained
        self.thresholds = tuple(sorted(thresholds_gpu_s))

    def queue(self, job: JobView) -> int:
        return bisect.bisect_right(self.thresholds, self.attained(job.id))

    def key(self, job: JobView) -> tuple:
        return (self.queue(job), job.submitted_at, job.id)

    def describe(self, job: JobView) -> str:
        return f"queue {self.queue(job)}, attained {self.attained(job.id) / 3600:.2f} device-hours"


class SRTFPolicy(PriorityPreemptivePolicy):
    """Oracle shortest-remaining-time-first; a reference that needs the future, not a policy."""

    name = "srtf"

    def __init__(self, remaining: Lookup):
        self.remaining = remaining

    def key(self, job: JobView) -> tuple:
        return (self.remaining(job.id), job.submitted_at, job.id)

    def describe(self, job: JobView) -> str:
        return f"remaining {self.remaining(job.id) / 3600:.2f} h at full size"


class PremiumFirstSRTFPolicy(SRTFPolicy):
    """The SRTF oracle with premium work first; no premium job is ever preempted."""

    name = "srtf-premium"

    def key(self, job: JobView) -> tuple:
        if job.sla == SLA.PREMIUM:
            return (0, job.state != JobState.RUNNING, job.submitted_at, job.id)
        return (1, self.remaining(job.id), job.submitted_at, job.id)

    def describe(self, job: JobView) -> str:
        return ("premium, " if job.sla == SLA.PREMIUM else "") + super().describe(job)
