"""The working copy of one Singularity scheduling round.

A round reads the immutable snapshot once into this mutable state, then every decision
(place, shrink, preempt, migrate, grow) goes through the few methods here, which keep the free
device map, the per-node counts of capacity that could be taken back, the per-user holdings
and the list of actions in step. Keeping the counts incrementally (numpy vectors over nodes)
is what makes a round over 10,000 jobs and 1,000 nodes cheap: choosing where to take
capacity back is a handful of vector operations, not a loop over nodes per waiting job.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from singularity_sdk.protocol import SLA, JobState

from .placement import DeviceMap, FreeDevices
from .quotas import over_quota
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
    placement: DeviceMap
    held: int
    running: bool  # RUNNING (not in a transition)
    protected: bool  # moved too recently to be touched (anti-thrash)
    #: fewest devices it may start on: an aged basic job keeps basic's freedom to start small
    #: on spare devices, while once running it is shrunk no further than standard allows
    start_min: int
    #: seconds spent waiting for devices since submission (``now - submitted_at - ran_s``; for a
    #: waiting job without ``ran_s``, since its last preemption or its submission)
    waited: float = 0.0
    attained: float = 0.0  # device-seconds held so far (JobView.attained_s)
    #: service class (0 = least served): waiting jobs of a tier go lowest class first
    las: int = 0
    #: class it counts in as a victim of same-tier work: its class when its attained service
    #: dwarfs the stall a move costs it, else 0 (nobody may take from it for LAS)
    las_victim: int = 0
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


def shrunk_placement(placement: DeviceMap, p: int) -> DeviceMap:
    """Devices a job keeps when it shrinks to ``p``: its fullest nodes, lowest indices first,
    so that a shrunk job stays packed and hands back whole nodes when it can."""
    keep: DeviceMap = {}
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

    def __init__(self, snapshot: Snapshot, config: PolicyConfig, previous: Optional[RoundState] = None):
        self.now = snapshot.now
        self.config = config
        self.free = FreeDevices(snapshot.nodes)
        self.names = list(self.free.size)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.size = np.array([self.free.size[n] for n in self.names], dtype=np.int64)
        self.nfree = np.array([len(self.free.free[n]) for n in self.names], dtype=np.int64)
        #: what a category offers where no job counts (read-only: ``capacity`` hands it out)
        self.nothing = np.zeros_like(self.nfree)
        self.nothing.flags.writeable = False
        #: ``las_cats[k]``: the same counts over the jobs whose victim class (``RJob.las_victim``)
        #: is at least k; ``cats`` is ``las_cats[0]``, every job. What a waiting job of class c
        #: may take from its own tier is ``las_cats[c + las_take_gap]``
        self.las_cats = np.zeros((len(config.las_thresholds_s) + 1, 4, len(self.names)), dtype=np.int64)
        #: node index -> jobs on it at the start of the round (only those untouched stay victims)
        self.node_jobs: dict[int, list[RJob]] = {}
        self.held_by: dict[tuple[int, str], int] = {}
        #: bumped whenever ``nfree`` or ``las_cats`` change; keys the cache of ``_most``
        self.version = 0
        self._most: dict[tuple, tuple[int, int]] = {}
        #: the jobs this round may act on: waiting ones, and running ones that may be shrunk,
        #: preempted, migrated or grown (others only count in ``held_by``)
        self.jobs: dict[str, RJob] = {}
        self.waiting: list[RJob] = []
        self.shrunk: list[RJob] = []
        self.actions: list[Action] = []
        #: placements by taking devices from running jobs still allowed this round
        self.takes_left = config.max_takes_per_round if config.max_takes_per_round is not None else 1 << 62
        #: job id -> devices held back for it this round (a starving job that did not fit)
        self.reserved: dict[str, DeviceMap] = {}
        #: jobs whose user is over a tier quota: the tier they run at this round
        self.demoted = over_quota(snapshot.jobs, snapshot.quotas)
        #: (own tier, effective tier, W) -> (min_p, start_min): the config's, kept across rounds
        self.mins: dict[tuple[SLA, SLA, int], tuple[int, int]] = {}
        last: dict[str, RJob] = {}
        if previous is not None and previous.config is config:
            self.mins = previous.mins
            if not previous.demoted and not self.demoted:
                last = previous.jobs
        self._read_jobs(snapshot.jobs, last)
        #: node index -> devices each category could free there (a view of ``las_cats``)
        self.cats = self.las_cats[0]

    # ------------------------------------------------------------------ reading the snapshot

    def _read_jobs(self, views: tuple[JobView, ...], last: dict[str, RJob]) -> None:
        # the hot loop of a round (every job, every round): locals only, no calls for the
        # common case of a job on one node. ``last``: the previous round's jobs. Most waiting
        # jobs wait through many rounds with the same view (the simulator keeps it until the job
        # changes), and building their round object was a tenth of a week's time: such a job is
        # taken over from ``last`` when it is the same view, untouched, at the same tier (no quota
        # in either round), and only its wait, which moves with the clock, is set again
        now, cfg = self.now, self.config
        interval = cfg.min_move_interval_s
        long_interval = cfg.long_move_interval_s
        long_service = cfg.long_move_after_s
        horizon = cfg.aging_horizon_s
        mins = self.mins
        running_state = JobState.RUNNING
        queued, preempted = JobState.QUEUED, JobState.PREEMPTED
        basic, standard = SLA.BASIC, SLA.STANDARD
        thresholds = cfg.las_thresholds_s
        stall_cost = cfg.las_margin * cfg.overhead_s
        n_nodes = len(self.names)
        #: flat index ((class * 4 + category) * nodes + node) -> devices, added in bulk
        track: dict[int, int] = {}
        jobs, waiting_jobs, shrunk, held_by = self.jobs, self.waiting, self.shrunk, self.held_by
        index, node_jobs = self.index, self.node_jobs
        demoted = self.demoted
        rank_of = RANK
        bisect_right = bisect.bisect_right
        for v in views:
            st = v.state
            waiting = st == queued or st == preempted
            if not waiting and st not in HOLDING:
                continue
            own = demoted.get(v.id, v.sla) if demoted else v.sla  # its tier within its user's quota
            sla = own
            gpus = v.gpus
            submitted = v.submitted_at
            ran = v.ran_s
            moved = v.last_moved_at
            if ran is not None:
                waited = aging = now - submitted - ran
            else:
                # unknown: basic jobs age with their time in the system (the rule before service
                # data); a waiting job has waited at least since its preemption or submission
                aging = now - submitted
                waited = now - (moved if moved is not None else submitted)
            if sla == basic and aging >= horizon:
                sla = standard  # aging (tiers module docstring)
            if waiting:
                job = last.get(v.id)
                if job is not None and job.view is v and job.sla is sla and not job.touched:
                    job.waited = waited  # taken over (see above): only its wait moved
                else:
                    sizes = mins.get((own, sla, gpus))
                    if sizes is None:
                        sizes = self._sizes(own, sla, gpus)
                    min_p, start_min = sizes if v.elastic else (gpus, gpus)
                    ckpt = v.last_checkpoint_at
                    attained = v.attained_s
                    las = bisect_right(thresholds, attained) if attained > 0.0 else 0
                    job = RJob(v, v.id, v.user, sla, rank_of[sla], gpus, min_p, submitted,
                               ckpt if ckpt is not None else submitted, {}, 0, False, False, start_min,
                               waited, attained, las, las)
                jobs[v.id] = job
                waiting_jobs.append(job)
                continue
            rank = rank_of[sla]
            # placements are replaced, never mutated, so the view's dict can be shared
            placement = v.placement
            held = 0
            for d in placement.values():
                held += len(d)
            running = st == running_state
            protected = moved is not None and now - moved < interval
            if protected and long_interval is not None and v.attained_s >= long_service and now - moved >= long_interval:
                protected = False
            if not running or protected or (rank == 2 and held >= gpus):
                # nothing this round may do to it (in transition, moved recently, premium at
                # full size): it only counts in its user's holdings
                key = (rank, v.user)
                held_by[key] = held_by.get(key, 0) + held
                continue
            sizes = mins.get((own, sla, gpus))
            if sizes is None:
                sizes = self._sizes(own, sla, gpus)
            min_p, start_min = sizes if v.elastic else (gpus, gpus)
            ckpt = v.last_checkpoint_at
            attained = v.attained_s
            las = las_victim = 0
            if attained > 0.0:
                las = bisect_right(thresholds, attained)
                if attained >= stall_cost * held:
                    las_victim = las
            job = RJob(v, v.id, v.user, sla, rank, gpus, min_p, submitted,
                       ckpt if ckpt is not None else submitted, placement, held, running, protected,
                       start_min, waited, attained, las, las_victim)
            jobs[v.id] = job
            key = (rank, job.user)
            held_by[key] = held_by.get(key, 0) + held
            for node in placement:
                i = index.get(node)
                if i is not None:
                    lst = node_jobs.get(i)
                    if lst is None:
                        node_jobs[i] = [job]
                    else:
                        lst.append(job)
            if running and not protected:
                if rank < 2:  # movable: count what taking it back would free, per node
                    base = (las_victim * 4 + (SHRINK_BASIC if rank == 0 else SHRINK_STANDARD)) * n_nodes
                    if len(placement) == 1:
                        (node,) = placement
                        i = index.get(node)
                        if i is None:
                            job.contrib = {}
                        else:
                            kept = min_p if min_p < held else held
                            job.contrib = {i: (held - kept, kept)}
                            track[base + i] = track.get(base + i, 0) + held - kept
                            track[base + n_nodes + i] = track.get(base + n_nodes + i, 0) + kept
                    else:
                        self._track(job, track, base)
                if held < gpus:
                    shrunk.append(job)
        if track:
            flat = self.las_cats.reshape(-1)  # a view: las_cats is contiguous
            flat[np.fromiter(track.keys(), np.int64, len(track))] += np.fromiter(track.values(), np.int64, len(track))
            # per class -> at least that class
            self.las_cats[:] = np.cumsum(self.las_cats[::-1], axis=0)[::-1]

    def _sizes(self, own: SLA, sla: SLA, gpus: int) -> tuple[int, int]:
        """(min_p, start_min) of an elastic job of tier ``own``, treated as ``sla``, of W = ``gpus``."""
        floor = min_devices(sla, gpus, self.config)
        sizes = self.mins[(own, sla, gpus)] = (floor, min(floor, min_devices(own, gpus, self.config)))
        return sizes

    def _track(self, job: RJob, track: dict[int, int], base: int) -> None:
        """What taking back a job on several nodes would free, per node (added in bulk)."""
        keep = shrunk_placement(job.placement, job.min_p) if job.min_p < job.held else job.placement
        contrib: dict[int, tuple[int, int]] = {}
        n_nodes = len(self.names)
        for node, devs in job.placement.items():
            i = self.index.get(node)
            if i is None:
                continue
            kept = len(keep.get(node, ()))
            freed = len(devs) - kept
            contrib[i] = (freed, kept)
            track[base + i] = track.get(base + i, 0) + freed
            track[base + n_nodes + i] = track.get(base + n_nodes + i, 0) + kept
        job.contrib = contrib

    def _untrack(self, job: RJob) -> None:
        if job.contrib is None:
            return
        shrink_cat = SHRINK_BASIC if job.rank == 0 else SHRINK_STANDARD
        upto = job.las_victim + 1  # counted in every "at least k" row with k <= its class
        self.version += 1
        for i, (freed, kept) in job.contrib.items():
            self.las_cats[:upto, shrink_cat, i] -= freed
            self.las_cats[:upto, shrink_cat + 1, i] -= kept
        job.contrib = None

    # ------------------------------------------------------------------ device bookkeeping

    def give_devices(self, placement: DeviceMap) -> None:
        self.version += 1
        for node, devs in placement.items():
            if node in self.free.free:
                self.free.give(node, devs)
                self.nfree[self.index[node]] += len(devs)

    def take_devices(self, placement: DeviceMap) -> None:
        self.version += 1
        for node, devs in placement.items():
            if node in self.free.free:  # devices on unschedulable nodes are not tracked
                self.free.take(node, devs)
                self.nfree[self.index[node]] -= len(devs)

    def _set_placement(self, job: RJob, new: DeviceMap) -> None:
        old = job.placement
        release: DeviceMap = {}
        acquire: DeviceMap = {}
        # in the placements' order: iterating a set of names would follow the string hash,
        # which changes from one process to the next, and with it the free-device buckets'
        # order, best fit's choices and a simulation's figures
        for node in [*old, *(n for n in new if n not in old)]:
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

    def place(self, job: RJob, placement: DeviceMap, reason: str) -> None:
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

    def resize(self, job: RJob, placement: DeviceMap, reason: str) -> None:
        self._untrack(job)
        self._set_placement(job, placement)
        job.touched = True
        self.actions.append(Resize(job.id, placement, reason=reason))

    def migrate(self, job: RJob, placement: DeviceMap, reason: str) -> None:
        self._untrack(job)
        self._set_placement(job, placement)
        job.touched = True
        self.actions.append(Migrate(job.id, placement, reason=reason))

    # ------------------------------------------------------------------ queries

    def held(self, rank: int, user: str) -> int:
        return self.held_by.get((rank, user), 0)

    def capacity(self, c: int, las: Optional[tuple[int, int]], lower_min: int = 0) -> np.ndarray:
        """Devices per node that category ``c`` offers; with ``las = (rank, cls)`` the jobs of
        that rank or above count only if their victim class is ``cls + las_take_gap`` or more (LAS).
        ``lower_min``: basic jobs count only from that victim class up (standard work's takes)."""
        if las is not None and CATEGORY[c][0] >= las[0]:
            k = las[1] + self.config.las_take_gap
            return self.las_cats[k, c] if k < len(self.las_cats) else self.nothing
        if lower_min and CATEGORY[c][0] == 0:
            return self.las_cats[lower_min, c] if lower_min < len(self.las_cats) else self.nothing
        return self.cats[c]

    def reclaim_candidates(
        self,
        p: int,
        cats: tuple[int, ...],
        limit: int,
        whole: bool = False,
        exclude: frozenset[int] = frozenset(),
        las: Optional[tuple[int, int]] = None,
        lower_min: int = 0,
    ) -> list[int]:
        """Nodes where ``p`` devices can be had from free devices plus ``cats``, cheapest first.

        Cost follows the category order (shrink basic < preempt basic < shrink standard <
        preempt standard), then more free devices, then node order. ``whole`` restricts to
        nodes of the largest size (for the whole-node part of a multi-node job). ``las``: see
        :meth:`capacity`.
        """
        key = (cats, las, lower_min)
        hit = self._most.get(key)
        if hit is None or hit[0] != self.version:
            # the most devices any node could offer (free + every category): most waiting jobs
            # find no node, and this bound, kept until the counts change, says so at once
            avail = self.nfree.copy()
            for c in cats:
                avail += self.capacity(c, las, lower_min)
            hit = self._most[key] = (self.version, int(avail.max()))
        if hit[1] < p:
            return []
        need = p - self.nfree
        rem = np.maximum(need, 0)
        cost = np.zeros(len(self.names))
        for c in cats:
            take = np.minimum(rem, self.capacity(c, las, lower_min))
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
