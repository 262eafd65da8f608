"""The working copy of one Singularity scheduling round.

A round reads the immutable snapshot once into this mutable state, then every decision
(place, shrink, preempt, migrate, grow) goes through the few methods here, which keep the free
device map, the per-node counts of capacity that could be taken back, the per-user holdings
and the list of actions in step. Keeping the counts incrementally (numpy vectors over nodes)
is what makes a round over 10,000 jobs and 1,000 nodes cheap: choosing where to take
capacity back is a handful of vector operations, not a loop over nodes per waiting job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from singularity_sdk.protocol import SLA, JobState

from .placement import FreeDevices, Placement
from .tiers import RANK, PolicyConfig, min_devices
from .types import Action, JobView, Migrate, Place, Preempt, Resize, Snapshot

#: Capacity categories, in the order a waiting job takes them: shrink basic, preempt basic,
#: shrink standard, preempt standard. Premium work is never a victim.
SHRINK_BASIC, PREEMPT_BASIC, SHRINK_STANDARD, PREEMPT_STANDARD = range(4)
CATEGORY = {
    SHRINK_BASIC: (0, "shrink"),
    PREEMPT_BASIC: (0, "preempt"),
    SHRINK_STANDARD: (1, "shrink"),
    PREEMPT_STANDARD: (1, "preempt"),
}
#: Relative cost of taking one device through each category: on a node of up to 8 devices
#: every category is dearer than all earlier ones together, so the cheapest node is the one
#: that needs the least of the dearest kind.
CATEGORY_COST = np.array([1.0, 16.0, 256.0, 4096.0])

WAITING = frozenset({JobState.QUEUED, JobState.PREEMPTED})
HOLDING = frozenset({JobState.RUNNING, JobState.PREEMPTING, JobState.MIGRATING, JobState.RESIZING})


@dataclass(eq=False, slots=True)
class RJob:
    """A job as the round sees it: effective tier, size limits, and where it is now."""

    view: JobView
    id: str
    user: str
    sla: SLA  # effective tier (aging applied)
    rank: int
    gpus: int
    min_p: int  # fewest devices it may be shrunk to (its effective tier's minimum)
    submitted_at: float
    ckpt: float  # newest checkpoint, else submission: the work a move would lose starts here
    placement: Placement
    held: int
    running: bool  # RUNNING (not in a transition)
    protected: bool  # moved too recently to be touched (anti-thrash)
    #: fewest devices it may start on: an aged basic job keeps basic's freedom to start small
    #: on spare devices, while once running it is shrunk no further than standard allows
    start_min: int
    touched: bool = False
    displaced: bool = False  # preempted in this round: may resume on spare devices at its end
    #: node index -> (devices freed there by shrinking to min_p, devices freed by preempting after)
    contrib: Optional[dict[int, tuple[int, int]]] = field(default=None)

    @property
    def victim_key(self) -> tuple:
        """Order among victims of one tier: least work lost (newest checkpoint), newest job."""
        return (-self.ckpt, -self.submitted_at, self.id)

    @property
    def movable(self) -> bool:
        return self.running and not self.protected and not self.touched and self.rank < 2


def shrunk_placement(placement: Placement, p: int) -> Placement:
    """Devices a job keeps when it shrinks to ``p``: its fullest nodes, lowest indices first,
    so that a shrunk job stays packed and hands back whole nodes when it can."""
    keep: Placement = {}
    left = p
    for node, devs in sorted(placement.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if left <= 0:
            break
        k = min(len(devs), left)
        keep[node] = tuple(sorted(devs)[:k])
        left -= k
    return keep


class RoundState:
    """Mutable state of one round; every change goes through the methods below."""

    def __init__(self, snapshot: Snapshot, config: PolicyConfig):
        self.now = snapshot.now
        self.config = config
        self.free = FreeDevices(snapshot.nodes)
        self.names = list(self.free.size)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.size = np.array([self.free.size[n] for n in self.names], dtype=np.int64)
        self.nfree = np.array([len(self.free.free[n]) for n in self.names], dtype=np.int64)
        self.cats = np.zeros((4, len(self.names)), dtype=np.int64)
        #: node index -> jobs on it at the start of the round (only those untouched stay victims)
        self.node_jobs: dict[int, list[RJob]] = {}
        self.held_by: dict[tuple[int, str], int] = {}
        self.jobs: dict[str, RJob] = {}
        self.waiting: list[RJob] = []
        self.shrunk: list[RJob] = []
        self.actions: list[Action] = []
        self._read_jobs(snapshot.jobs)

    # ------------------------------------------------------------------ reading the snapshot

    def _read_jobs(self, views: tuple[JobView, ...]) -> None:
        now, cfg = self.now, self.config
        interval = cfg.min_move_interval_s
        aged_before = now - cfg.aging_horizon_s
        mins: dict[tuple[SLA, SLA, int], tuple[int, int]] = {}
        running_state = JobState.RUNNING
        for v in views:
            st = v.state
            waiting = st in WAITING
            if not waiting and st not in HOLDING:
                continue
            sla = v.sla
            if sla == SLA.BASIC and v.submitted_at <= aged_before:
                sla = SLA.STANDARD  # aging: see tiers.effective_sla
            sizes = mins.get((v.sla, sla, v.gpus))
            if sizes is None:
                floor = min_devices(sla, v.gpus, cfg)
                sizes = mins[(v.sla, sla, v.gpus)] = (floor, min(floor, min_devices(v.sla, v.gpus, cfg)))
            min_p, start_min = sizes if v.elastic else (v.gpus, v.gpus)
            # placements are replaced, never mutated, so the view's dict can be shared
            placement = {} if waiting else v.placement
            held = 0
            for d in placement.values():
                held += len(d)
            moved = v.last_moved_at
            ckpt = v.last_checkpoint_at
            job = RJob(
                v,
                v.id,
                v.user,
                sla,
                RANK[sla],
                v.gpus,
                min_p,
                v.submitted_at,
                ckpt if ckpt is not None else v.submitted_at,
                placement,
                held,
                st == running_state,
                moved is not None and now - moved < interval,
                start_min,
            )
            self.jobs[v.id] = job
            if waiting:
                self.waiting.append(job)
                continue
            key = (job.rank, job.user)
            self.held_by[key] = self.held_by.get(key, 0) + held
            index = self.index
            for node in placement:
                i = index.get(node)
                if i is not None:
                    self.node_jobs.setdefault(i, []).append(job)
            if job.movable:
                self._track(job)
            if job.running and not job.protected and held < job.gpus:
                self.shrunk.append(job)

    def _track(self, job: RJob) -> None:
        """Count what taking this job back would free, per node."""
        keep = shrunk_placement(job.placement, job.min_p) if job.min_p < job.held else job.placement
        contrib: dict[int, tuple[int, int]] = {}
        shrink_cat = SHRINK_BASIC if job.rank == 0 else SHRINK_STANDARD
        for node, devs in job.placement.items():
            i = self.index.get(node)
            if i is None:
                continue
            kept = len(keep.get(node, ()))
            freed = len(devs) - kept
            contrib[i] = (freed, kept)
            self.cats[shrink_cat, i] += freed
            self.cats[shrink_cat + 1, i] += kept
        job.contrib = contrib

    def _untrack(self, job: RJob) -> None:
        if job.contrib is None:
            return
        shrink_cat = SHRINK_BASIC if job.rank == 0 else SHRINK_STANDARD
        for i, (freed, kept) in job.contrib.items():
            self.cats[shrink_cat, i] -= freed
            self.cats[shrink_cat + 1, i] -= kept
        job.contrib = None

    # ------------------------------------------------------------------ device bookkeeping

    def give_devices(self, placement: Placement) -> None:
        for node, devs in placement.items():
            if node in self.free.free:
                self.free.give(node, devs)
                self.nfree[self.index[node]] += len(devs)

    def take_devices(self, placement: Placement) -> None:
        for node, devs in placement.items():
            if node in self.free.free:  # devices on unschedulable nodes are not tracked
                self.free.take(node, devs)
                self.nfree[self.index[node]] -= len(devs)

    def _set_placement(self, job: RJob, new: Placement) -> None:
        old = job.placement
        release: Placement = {}
        acquire: Placement = {}
        for node in set(old) | set(new):
            o, n = set(old.get(node, ())), set(new.get(node, ()))
            if o - n:
                release[node] = tuple(sorted(o - n))
            if n - o:
                acquire[node] = tuple(sorted(n - o))
        self.give_devices(release)
        self.take_devices(acquire)
        key = (job.rank, job.user)
        new_held = sum(len(d) for d in new.values())
        self.held_by[key] = self.held_by.get(key, 0) + new_held - job.held
        job.placement = new
        job.held = new_held

    # ------------------------------------------------------------------ actions

    def place(self, job: RJob, placement: Placement, reason: str) -> None:
        self._set_placement(job, placement)
        job.touched = True
        self.actions.append(Place(job.id, placement, reason=reason))

    def preempt(self, job: RJob, reason: str) -> None:
        self._untrack(job)
        self._set_placement(job, {})
        job.touched = True
        job.displaced = True
        self.waiting.append(job)
        self.actions.append(Preempt(job.id, reason=reason))

    def resize(self, job: RJob, placement: Placement, reason: str) -> None:
        self._untrack(job)
        self._set_placement(job, placement)
        job.touched = True
        self.actions.append(Resize(job.id, placement, reason=reason))

    def migrate(self, job: RJob, placement: Placement, reason: str) -> None:
        self._untrack(job)
        self._set_placement(job, placement)
        job.touched = True
        self.actions.append(Migrate(job.id, placement, reason=reason))

    # ------------------------------------------------------------------ queries

    def held(self, rank: int, user: str) -> int:
        return self.held_by.get((rank, user), 0)

    def reclaim_candidates(
        self, p: int, cats: tuple[int, ...], limit: int, whole: bool = False, exclude: frozenset[int] = frozenset()
    ) -> list[int]:
        """Nodes where ``p`` devices can be had from free devices plus ``cats``, cheapest first.

        Cost follows the category order (shrink basic < preempt basic < shrink standard <
        preempt standard), then more free devices, then node order. ``whole`` restricts to
        nodes of the largest size (for the whole-node part of a multi-node job).
        """
        need = p - self.nfree
        rem = np.maximum(need, 0)
        cost = np.zeros(len(self.names))
        for c in cats:
            take = np.minimum(rem, self.cats[c])
            cost += take * CATEGORY_COST[c]
            rem = rem - take
        ok = (rem == 0) & (need > 0) & (self.size >= p)
        if whole:
            ok &= self.size == self.free.max_size
        cand = np.flatnonzero(ok)
        if exclude:
            cand = np.array([i for i in cand if i not in exclude], dtype=np.int64)
        if len(cand) == 0:
            return []
        order = np.lexsort((cand, -self.nfree[cand], cost[cand]))
        return [int(i) for i in cand[order[:limit]]]
