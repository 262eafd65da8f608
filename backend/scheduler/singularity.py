"""The Singularity policy: SLA tiers, elastic (spliced) jobs, work conservation, defragmentation,
least attained service across standard and basic work.

One round, in this order (docs/scheduling.md has the full rules):

for each pass, premium, then standard and basic together (``las_across``; else one per tier):
  1. waiting jobs of the pass (queued or preempted): those that have waited past the
     starvation horizon first (oldest first); then by service class, least attained service
     first (``JobView.attained_s``), standard before basic within a class; then fair share
     between users (the user holding fewest devices in the tier goes next), FIFO within a
     user. Each tries, for each allowed size P (divisors of W from W down to the tier's
     minimum): free devices; defragmentation; taking back from lower tiers. A job that still
     does not fit may take from running standard and basic jobs that have had far more service
     (shrink, then preempt; per tier: its own tier only, standard only shrunk), and a standard
     job may shrink standard jobs of users holding more than its user (fair share). A
     starving job that fits nowhere has one node's free devices held for it.
  2. shrunk jobs of the pass grow back into idle devices (work conservation), fairest first;
     when no node has room and no job waits, by migrating smaller jobs off the job's node.
then, if devices are still free, one more pass over every tier using free devices only, in
which victims displaced earlier in the round may resume at once (preempt + resume elsewhere).

The function is pure: it reads the snapshot and returns actions in the order they must be
applied (a Place may use devices that a Preempt/Resize/Migrate before it frees).
"""
from __future__ import annotations

import heapq
from collections import deque
from operator import attrgetter
from typing import Iterator, Optional

import numpy as np

from singularity_sdk.protocol import JobState

from .defrag import defragment
from .placement import DeviceMap, divisors, fmt_placement
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
#: What a waiting job may take from its own tier by least attained service (with lower tiers):
#: standard work is only ever shrunk for standard work, basic work shrunk, then preempted.
LAS_TAKE = {1: (SHRINK_BASIC, PREEMPT_BASIC, SHRINK_STANDARD), 0: (SHRINK_BASIC, PREEMPT_BASIC)}
#: With ``las_across``: standard and basic work form one pool ordered by attained service, and
#: a waiting job may shrink, then preempt, any non-premium job far above it in service (a
#: job of a lower tier whatever its service), as Tiresias does for every job.
LAS_ACROSS = (SHRINK_BASIC, PREEMPT_BASIC, SHRINK_STANDARD, PREEMPT_STANDARD)
#: FIFO order of waiting jobs (a C-level key: every waiting job is sorted by it in every pass)
_FIFO = attrgetter("submitted_at", "id")


def singularity_policy(snapshot: Snapshot, config: PolicyConfig = PolicyConfig()) -> list[Action]:
    """One scheduling round: snapshot in, ordered actions out (pure)."""
    return _round(RoundState(snapshot, config))


def _round(state: RoundState) -> list[Action]:
    """The passes of one round over its read state; the actions in the order they apply."""
    config = state.config
    if not state.names:
        return []
    passes = ((2,), (1, 0)) if config.las_across else ((2,), (1,), (0,))
    for ranks in passes:
        _Tier(state, ranks).place_waiting()
        for rank in ranks:
            _grow(state, rank)
    if state.free.total:
        # devices still free at the end (a job grown onto another node freed its old ones, a
        # victim freed more than was needed, devices no waiting job could use) go to whoever
        # still waits and fits, victims displaced in this round included (preempt + resume
        # elsewhere is a migration), without taking from anyone
        for ranks in passes:
            _Tier(state, ranks, free_only=True).place_waiting()
    return state.actions


class SingularityPolicy:
    """The policy as a callable object, carrying its config (what the simulator and server hold)."""

    name = "singularity"

    def __init__(self, config: PolicyConfig = PolicyConfig()):
        self.config = config
        #: the last round that ran to its end: its waiting jobs are read again without being
        #: rebuilt when their views come back unchanged (``RoundState._read_jobs``); the
        #: actions are the same as ``singularity_policy``'s
        self._previous: Optional[RoundState] = None

    @property
    def min_move_interval_s(self) -> float:
        return self.config.min_move_interval_s

    def __call__(self, snapshot: Snapshot) -> list[Action]:
        # taken, not shared: two rounds at once (or one that failed) never reuse the same jobs
        previous, self._previous = self._previous, None
        state = RoundState(snapshot, self.config, previous)
        actions = _round(state)
        self._previous = state
        return actions


class _Tier:
    """Places the waiting jobs of one tier, or of several tiers in one pool (``las_across``)."""

    def __init__(self, state: RoundState, ranks: tuple[int, ...], free_only: bool = False):
        self.state = state
        self.ranks = ranks
        self.free_only = free_only
        self.across = len(ranks) > 1
        self.jobs = [
            j for j in state.waiting
            if j.rank in ranks and (not j.touched or (free_only and j.displaced and not j.held))
        ]
        #: per rank, smallest minimum size that failed every tenant-independent attempt: a job
        #: of that rank needing at least as much cannot succeed either while free devices do
        #: not grow (free devices and capacity to take back only shrink, except when a victim
        #: frees more than needed)
        self.fail_floor: dict[int, int] = {}
        self.fail_user: dict[str, int] = {}
        self.fail_las: dict[tuple[int, int], int] = {}  # (rank, class) -> smallest failed minimum
        self.fail_free = -1  # free devices when the failures above were recorded
        #: one reservation per pass and round: for the longest-waiting starving job that does
        #: not fit (holding devices for every starving job would idle too many)
        self.reserve_left = not free_only

    def order(self) -> Iterator[RJob]:
        """Starving jobs first (waited past the starvation horizon; oldest first); then by
        service class, least attained service first (in a pool of tiers, the higher tier first
        within a class); then fair share between users (the user holding fewest devices in the
        tier goes next), FIFO per user."""
        st = self.state
        cfg = st.config
        horizon = cfg.starvation_horizon_s
        held = st.held_by  # read directly: a hundred jobs a round go through this heap
        # one sweep in FIFO order sorts them out (a job's wait, class and user stay put in a round)
        starving: list[RJob] = []
        groups: dict[tuple[int, int], dict[str, deque[RJob]]] = {}
        for j in sorted(self.jobs, key=_FIFO):
            if j.waited >= horizon:
                starving.append(j)
                continue
            key = (j.las if cfg.las_order else 0, -j.rank)
            per_user = groups.get(key)
            if per_user is None:
                per_user = groups[key] = {}
            q = per_user.get(j.user)
            if q is None:
                per_user[j.user] = deque((j,))
            else:
                q.append(j)
        yield from starving
        for (_, neg_rank), per_user in sorted(groups.items()):
            rank = -neg_rank
            heap = [(held.get((rank, u), 0), q[0].submitted_at, u) for u, q in per_user.items()]
            heapq.heapify(heap)
            while heap:
                _, _, user = heapq.heappop(heap)
                q = per_user[user]
                yield q.popleft()
                if q:
                    heapq.heappush(heap, (held.get((rank, user), 0), q[0].submitted_at, user))

    def hopeless(self) -> bool:
        """Nothing free and nothing these tiers may take: skip them without looking at jobs."""
        st = self.state
        if st.free.total > 0:
            return False
        if self.free_only or st.takes_left <= 0:
            return True
        for rank in self.ranks:
            cats = list(LOWER[rank] + ((SHRINK_STANDARD,) if self._same_tier(rank) else ()))
            if cats and int(st.cats[cats].sum()) > 0:
                return False
            if self._las(rank):
                # what the least served waiting job (class 0) could take from its own tier
                gap = st.config.las_take_gap
                if gap < len(st.las_cats) and int(st.las_cats[gap, list(self._las_cats(rank))].sum()) > 0:
                    return False
        return True

    def _same_tier(self, rank: int) -> bool:
        st = self.state
        return rank == 1 and st.config.same_tier_shrink and not self.free_only and st.takes_left > 0

    def _las(self, rank: int) -> bool:
        st = self.state
        return rank < 2 and st.config.las_take and not self.free_only and st.takes_left > 0

    def _las_cats(self, rank: int) -> tuple[int, ...]:
        return LAS_ACROSS if self.across else LAS_TAKE[rank]

    def place_waiting(self) -> None:
        if not self.jobs or self.hopeless():
            return
        actions = self.state.actions
        horizon = self.state.config.starvation_horizon_s
        checked_at = len(actions)
        for job in self.order():
            # the answer can only change when an action changed the cluster
            if len(actions) != checked_at:
                checked_at = len(actions)
                if self.hopeless():
                    return
            # a hundred jobs a round fail their try: the rarest condition (starving) goes first
            if not self._try(job) and job.waited >= horizon and self.reserve_left and job.view.nodes is None:
                self.reserve_left = False
                self._reserve(job)

    def _reserve(self, job: RJob) -> None:
        """Hold, for the rest of the round, the free devices of the node nearest to fitting a
        starving job (the most free devices), so that the jobs behind it cannot take every
        device as it frees up: a large job would otherwise wait as long as small ones keep
        coming. Rounds repeat the choice, so the node fills up for it."""
        st = self.state
        p = job.start_min
        if p > st.free.max_size:
            return  # a multi-node job: not reserved for (see docs/scheduling.md)
        ok = np.flatnonzero((st.size >= p) & (st.nfree > 0))
        if len(ok) == 0:
            return
        i = int(ok[np.lexsort((ok, -st.nfree[ok]))[0]])
        node = st.names[i]
        devs = tuple(st.free.free[node])
        st.take_devices({node: devs})
        st.reserved[job.id] = {node: devs}

    def _try(self, job: RJob) -> bool:
        st = self.state
        rank = job.rank
        if job.view.nodes is not None:
            # Its checkpoint resumes exactly only on some nodes: free devices there, or it waits.
            # Nothing is taken from others for it, and its failure says nothing about other jobs.
            for p in divisors(job.gpus):
                if p < job.start_min:
                    break
                got = self._attempt(job, p)
                if got is not None:
                    st.place(job, got[0], _place_reason(job, got[0], p, f"{got[1]} where its checkpoint "
                                                                        f"resumes exactly", st))
                    return True
            return False
        if st.free.total > self.fail_free >= 0:
            self.fail_floor, self.fail_user, self.fail_las, self.fail_free = {}, {}, {}, -1
        if job.start_min < self.fail_floor.get(rank, 1 << 30):
            for p in divisors(job.gpus):
                if p < job.start_min:
                    break
                got = self._attempt(job, p)
                if got is not None:
                    placement, how = got
                    st.place(job, placement, _place_reason(job, placement, p, how, st))
                    return True
            self.fail_floor[rank] = job.start_min
            self.fail_free = st.free.total
        # the failure records before the flags, here and below: they turn most jobs away (two
        # million tries on a week), at a dict lookup
        if job.start_min < self.fail_las.get((rank, job.las), 1 << 30) and self._las(rank):
            cats = self._las_cats(rank)
            for p in divisors(job.gpus):
                if p < job.start_min:
                    break
                placement = reclaim(st, job, p, cats, las=True)
                if placement is not None:
                    st.takes_left -= 1
                    how = (
                        f"took devices from jobs that have had far more service"
                        f" (least attained service first; it has had {job.attained / 3600:.2f} device-hours)"
                    )
                    st.place(job, placement, _place_reason(job, placement, p, how, st))
                    return True
            self.fail_las[(rank, job.las)] = job.start_min
            self.fail_free = st.free.total
        if job.start_min < self.fail_user.get(job.user, 1 << 30) and self._same_tier(rank):
            placement = reclaim(st, job, job.start_min, SAME_TIER)
            if placement is not None:
                st.takes_left -= 1
                how = "took devices from standard jobs of users holding more (fair share)"
                st.place(job, placement, _place_reason(job, placement, job.start_min, how, st))
                return True
            self.fail_user[job.user] = job.start_min
            self.fail_free = st.free.total
        return False

    def _attempt(self, job: RJob, p: int) -> Optional[tuple[DeviceMap, str]]:
        st = self.state
        placement = st.free.pick(p, only=job.view.nodes)
        if placement is not None:
            return placement, "free devices"
        if self.free_only or job.view.nodes is not None or st.takes_left <= 0:
            return None  # making room elsewhere could free devices it may not use
        placement = defragment(st, job, p)
        if placement is not None:
            st.takes_left -= 1
            return placement, "after migrating smaller jobs off the node (defragmentation)"
        cats = LOWER[job.rank]
        if cats:
            placement = reclaim(st, job, p, cats)
            if placement is not None:
                st.takes_left -= 1
                return placement, "took devices back from lower tiers"
        return None


def _place_reason(job: RJob, placement: DeviceMap, p: int, how: str, st: RoundState) -> str:
    if job.displaced:
        return (
            f"resumed on {fmt_placement(placement)}, {p} of {job.gpus} devices, right after being displaced:"
            f" spare devices nobody waiting could use ({job.sla} job)"
        )
    verb = "resumed" if job.view.state == JobState.PREEMPTED else "placed"
    tier = str(job.view.sla)
    own = st.demoted.get(job.id, job.view.sla)
    if own != job.view.sla:
        tier = f"{job.view.sla} over its user's {job.view.sla} quota, runs as {own}"
    if job.sla != own:
        tier += f" aged past {st.config.aging_horizon_s / 3600:g} h, treated as {job.sla}"
    size = f"{p} of {job.gpus} devices"
    if p < job.gpus:
        size += f" (shrunk, splicing factor {job.gpus // p}; grows back when devices free up)"
    turn = "next in queue"
    if job.waited >= st.config.starvation_horizon_s:
        turn = f"first in queue, waited {job.waited / 3600:.1f} h (past the starvation horizon)"
    return f"{verb} on {fmt_placement(placement)}, {size}: {tier} job, {turn}; {how}"


def _grow(state: RoundState, rank: int) -> None:
    """Give idle devices back to shrunk jobs of this tier when the speed-up beats the stall."""
    if state.free.total == 0:
        return
    cfg = state.config
    jobs = [j for j in state.shrunk if j.rank == rank and not j.touched]
    jobs.sort(key=lambda j: (state.held(rank, j.user), j.submitted_at, j.id))
    # migrating others to grow a job pays only when nobody waits for the devices it would use
    # (None: not looked at yet; most rounds never need to)
    defrag_ok: Optional[bool] = None if cfg.defrag_grow else False
    for j in jobs:
        if state.free.total == 0:
            return
        if j.touched:
            continue  # migrated to make room for a job grown before it
        old = j.placement
        prefer = [n for n, _ in sorted(old.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        age = max(0.0, state.now - j.submitted_at)
        state.give_devices(old)
        chosen: Optional[tuple[int, DeviceMap]] = None
        how = ""
        sizes: list[tuple[int, float]] = []
        for p in divisors(j.gpus):
            if p <= j.held:
                break
            gain = age * j.gpus * (1.0 / j.held - 1.0 / p)
            if gain <= cfg.grow_margin * cfg.overhead_s:
                break  # smaller sizes gain even less
            sizes.append((p, gain))
            placement = state.free.pick(p, prefer=prefer, only=j.view.nodes)
            if placement is not None:
                chosen = (p, placement)
                break
        if chosen is None and sizes and defrag_ok is not False and j.view.nodes is None and state.takes_left > 0:
            if defrag_ok is None:
                defrag_ok = all(w.touched for w in state.waiting)
            if defrag_ok:
                chosen = _grow_defrag(state, j, old, sizes)
                if chosen is not None:
                    state.takes_left -= 1
                    how = " after migrating smaller jobs (defragmentation)"
        state.take_devices(old)
        if chosen is not None:
            p, placement = chosen
            state.resize(
                j,
                placement,
                f"grown {j.held}->{p} of {j.gpus} devices on {fmt_placement(placement)}:"
                f" devices were idle (work-conserving){how}; {BY_RANK[rank]} tier",
            )


def _grow_defrag(
    state: RoundState, j: RJob, old: DeviceMap, sizes: list[tuple[int, float]]
) -> Optional[tuple[int, DeviceMap]]:
    """Room for a shrunk job to grow made by migrating smaller jobs: off its own node (a job on
    one node), or off one more whole node (a job on whole nodes short of one). Its devices are
    free (given back) on entry and on return."""
    big = state.free.max_size
    j.touched = True  # never a mover for itself
    try:
        for p, gain in sizes:
            if p <= big:
                i = state.index.get(next(iter(old))) if len(old) == 1 else None
                if i is not None:
                    placement = defragment(state, j, p, node_index=i, gain=gain * p)
                    if placement is not None:
                        return p, placement
            elif p - j.held == big and all(len(d) == state.free.size[n] for n, d in old.items()):
                state.take_devices(old)  # the moved jobs must not land on its own devices
                try:
                    placement = defragment(state, j, big, gain=gain * p)
                finally:
                    state.give_devices(old)
                if placement is not None:
                    return p, {**old, **placement}
    finally:
        j.touched = False
    return None
