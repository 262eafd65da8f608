"""The Singularity policy: SLA tiers, elastic (spliced) jobs, work conservation, defragmentation.

One round, in this order (docs/scheduling.md has the full rules):

for each tier, premium, then standard, then basic:
  1. waiting jobs of the tier (queued or preempted), aged ones first, then fair share between
     users (the user holding fewest devices in the tier goes next), FIFO within a user. Each
     tries, for each allowed size P (divisors of W from W down to the tier's minimum):
     free devices; defragmentation; taking back from lower tiers. A standard job that still
     does not fit may shrink standard jobs of users holding more than its user (fair share).
  2. shrunk jobs of the tier grow back into idle devices (work conservation), fairest first.
then, if devices are still free, one more pass over every tier using free devices only, in
which victims displaced earlier in the round may resume at once (preempt + resume elsewhere).

The function is pure: it reads the snapshot and returns actions in the order they must be
applied (a Place may use devices that a Preempt/Resize/Migrate before it frees).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator, Optional

from singularity_sdk.protocol import JobState

from .defrag import defragment
from .placement import Placement, divisors, fmt_placement
from .reclaim import reclaim
from .round_state import (
    PREEMPT_BASIC,
    PREEMPT_STANDARD,
    SHRINK_BASIC,
    SHRINK_STANDARD,
    RJob,
    RoundState,
)
from .tiers import BY_RANK, PolicyConfig
from .types import Action, Snapshot

__all__ = ["PolicyConfig", "SingularityPolicy", "singularity_policy"]

#: What a waiting job of each rank may take from lower tiers.
LOWER = {
    2: (SHRINK_BASIC, PREEMPT_BASIC, SHRINK_STANDARD, PREEMPT_STANDARD),
    1: (SHRINK_BASIC, PREEMPT_BASIC),
    0: (),
}
#: What a waiting standard job may take when lower tiers are not enough (fair share in tier).
SAME_TIER = (SHRINK_BASIC, PREEMPT_BASIC, SHRINK_STANDARD)


def singularity_policy(snapshot: Snapshot, config: PolicyConfig = PolicyConfig()) -> list[Action]:
    """One scheduling round: snapshot in, ordered actions out (pure)."""
    state = RoundState(snapshot, config)
    if not state.names:
        return []
    for rank in (2, 1, 0):
        _Tier(state, rank).place_waiting()
        _grow(state, rank)
    if state.free.total:
        # devices still free at the end (a job grown onto another node freed its old ones, a
        # victim freed more than was needed, devices no waiting job could use) go to whoever
        # still waits and fits, victims displaced in this round included (preempt + resume
        # elsewhere is a migration), without taking from anyone
        for rank in (2, 1, 0):
            _Tier(state, rank, free_only=True).place_waiting()
    return state.actions


class SingularityPolicy:
    """The policy as a callable object, carrying its config (what the simulator and server hold)."""

    name = "singularity"

    def __init__(self, config: PolicyConfig = PolicyConfig()):
        self.config = config

    @property
    def min_move_interval_s(self) -> float:
        return self.config.min_move_interval_s

    def __call__(self, snapshot: Snapshot) -> list[Action]:
        return singularity_policy(snapshot, self.config)


class _Tier:
    """Places the waiting jobs of one tier."""

    def __init__(self, state: RoundState, rank: int, free_only: bool = False):
        self.state = state
        self.rank = rank
        self.free_only = free_only
        self.jobs = [
            j for j in state.waiting if j.rank == rank and (not j.touched or (free_only and j.displaced and not j.held))
        ]
        #: smallest minimum size that failed every tenant-independent attempt: a job needing at
        #: least as much cannot succeed either while free devices do not grow (free devices
        #: and capacity to take back only shrink, except when a victim frees more than needed)
        self.fail_floor = 1 << 30
        self.fail_user: dict[str, int] = {}
        self.fail_free = -1  # free devices when the failures above were recorded

    def order(self) -> Iterator[RJob]:
        """Aged jobs first (oldest first), then fair share between users, FIFO per user."""
        st = self.state
        horizon = st.config.aging_horizon_s
        aged = sorted((j for j in self.jobs if st.now - j.submitted_at >= horizon), key=lambda j: (j.submitted_at, j.id))
        yield from aged
        per_user: dict[str, deque[RJob]] = {}
        for j in sorted(self.jobs, key=lambda j: (j.submitted_at, j.id)):
            if st.now - j.submitted_at < horizon:
                per_user.setdefault(j.user, deque()).append(j)
        heap = [(st.held(self.rank, u), q[0].submitted_at, u) for u, q in per_user.items()]
        heapq.heapify(heap)
        while heap:
            _, _, user = heapq.heappop(heap)
            q = per_user[user]
            yield q.popleft()
            if q:
                heapq.heappush(heap, (st.held(self.rank, user), q[0].submitted_at, user))

    def hopeless(self) -> bool:
        """Nothing free and nothing this tier may take: skip it without looking at its jobs."""
        st = self.state
        if st.free.total > 0:
            return False
        if self.free_only:
            return True
        cats = list(LOWER[self.rank] + ((SHRINK_STANDARD,) if self._same_tier() else ()))
        return not cats or int(st.cats[cats].sum()) == 0

    def _same_tier(self) -> bool:
        return self.rank == 1 and self.state.config.same_tier_shrink and not self.free_only

    def place_waiting(self) -> None:
        if not self.jobs or self.hopeless():
            return
        checked_at = len(self.state.actions)
        for job in self.order():
            # the answer can only change when an action changed the cluster
            if len(self.state.actions) != checked_at:
                checked_at = len(self.state.actions)
                if self.hopeless():
                    return
            self._try(job)

    def _try(self, job: RJob) -> bool:
        st = self.state
        if st.free.total > self.fail_free >= 0:
            self.fail_floor, self.fail_user, self.fail_free = 1 << 30, {}, -1
        if job.start_min < self.fail_floor:
            for p in divisors(job.gpus):
                if p < job.start_min:
                    break
                got = self._attempt(job, p)
                if got is not None:
                    placement, how = got
                    st.place(job, placement, _place_reason(job, placement, p, how, st))
                    return True
            self.fail_floor = job.start_min
            self.fail_free = st.free.total
        if self._same_tier() and job.start_min < self.fail_user.get(job.user, 1 << 30):
            placement = reclaim(st, job, job.start_min, SAME_TIER)
            if placement is not None:
                how = "took devices from standard jobs of users holding more (fair share)"
                st.place(job, placement, _place_reason(job, placement, job.start_min, how, st))
                return True
            self.fail_user[job.user] = job.start_min
            self.fail_free = st.free.total
        return False

    def _attempt(self, job: RJob, p: int) -> Optional[tuple[Placement, str]]:
        st = self.state
        placement = st.free.pick(p)
        if placement is not None:
            return placement, "free devices"
        if self.free_only:
            return None
        placement = defragment(st, job, p)
        if placement is not None:
            return placement, "after migrating smaller jobs off the node (defragmentation)"
        cats = LOWER[self.rank]
        if cats:
            placement = reclaim(st, job, p, cats)
            if placement is not None:
                return placement, "took devices back from lower tiers"
        return None


def _place_reason(job: RJob, placement: Placement, p: int, how: str, st: RoundState) -> str:
    if job.displaced:
        return (
            f"resumed on {fmt_placement(placement)}, {p} of {job.gpus} devices, right after being displaced:"
            f" spare devices nobody waiting could use ({job.sla} job)"
        )
    verb = "resumed" if job.view.state == JobState.PREEMPTED else "placed"
    tier = str(job.sla)
    if job.sla != job.view.sla:
        tier = f"{job.view.sla} aged past {st.config.aging_horizon_s / 3600:g} h, treated as {job.sla}"
    size = f"{p} of {job.gpus} devices"
    if p < job.gpus:
        size += f" (shrunk, splicing factor {job.gpus // p}; grows back when devices free up)"
    return f"{verb} on {fmt_placement(placement)}, {size}: {tier} job, next in queue; {how}"


def _grow(state: RoundState, rank: int) -> None:
    """Give idle devices back to shrunk jobs of this tier when the speed-up beats the stall."""
    if state.free.total == 0:
        return
    cfg = state.config
    jobs = [j for j in state.shrunk if j.rank == rank and not j.touched]
    jobs.sort(key=lambda j: (state.held(rank, j.user), j.submitted_at, j.id))
    for j in jobs:
        if state.free.total == 0:
            return
        old = j.placement
        prefer = [n for n, _ in sorted(old.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        age = max(0.0, state.now - j.submitted_at)
        state.give_devices(old)
        chosen: Optional[tuple[int, Placement]] = None
        for p in divisors(j.gpus):
            if p <= j.held:
                break
            gain = age * j.gpus * (1.0 / j.held - 1.0 / p)
            if gain <= cfg.grow_margin * cfg.overhead_s:
                break  # smaller sizes gain even less
            placement = state.free.pick(p, prefer=prefer)
            if placement is not None:
                chosen = (p, placement)
                break
        state.take_devices(old)
        if chosen is not None:
            p, placement = chosen
            state.resize(
                j,
                placement,
                f"grown {j.held}->{p} of {j.gpus} devices on {fmt_placement(placement)}:"
                f" devices were idle (work-conserving); {BY_RANK[rank]} tier",
            )

