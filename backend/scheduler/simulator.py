"""Trace-driven simulator: replays a job trace through the SAME policy code as the server.

Job model:
- a job's work is its recorded duration at its requested size W; on P < W devices (P divides W,
  replica splicing) it progresses at P/W of full speed;
- every preemption, migration or resize costs ``overhead_s`` seconds during which the job holds
  its (new) devices and makes no progress; a preemption releases the devices at once and the
  job pays the overhead when it resumes; a first start costs nothing;
- devices released by a Preempt/Resize/Migrate are free for the actions after it in the same
  round (the policy returns actions in the order they apply).

The clock is event-driven: it jumps to the next arrival, completion, end of an overhead, or
(for policies with an anti-thrash interval) the moment a moved job may be moved again, and a
scheduling round runs at each such time. Progress is computed lazily from (remaining work,
reference time, devices, stall end), so a step costs O(jobs that changed), not O(running).

Conservation of devices is checked on every action (a device has at most one owner, the
count held never exceeds the cluster) and at the end (device-time held = useful + overhead).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from singularity_sdk.protocol import SLA, JobState

from .baselines import PremiumFirstSRTFPolicy, SRTFPolicy, TiresiasPolicy, fifo_backfill_policy, fifo_gang_policy
from .metrics import Finished, SimReport, format_report, summarize
from .placement import fits_locality
from .quotas import Quotas
from .singularity import PolicyConfig, SingularityPolicy
from .trace import TraceJob, load_trace
from .types import Action, JobView, Migrate, NodeView, Place, Preempt, Resize, Snapshot

Policy = Callable[[Snapshot], list[Action]]
POLICIES = ("singularity", "fifo", "fifo-backfill", "tiresias", "srtf", "srtf-premium")

_DONE, _STALL_END, _WAKE = 0, 1, 2
_new_view = object.__new__
_set_dict = object.__setattr__
#: wake-ups for anti-thrash expiry are rounded up to this grid so that many moves share a round
_WAKE_GRID_S = 60.0


class InvalidAction(RuntimeError):
    """A policy asked for something impossible: a bug in the policy, never a scheduling outcome."""


class SimJob:
    """Mutable state of one job in the simulation."""

    __slots__ = (
        "id", "user", "sla", "gpus", "submit", "duration", "state", "placement", "held", "rem",
        "t_ref", "stall_until", "attained", "overhead_ds", "start", "finish", "last_moved_at",
        "last_checkpoint_at", "version", "view", "ran", "fields",
    )

    def __init__(self, tj: TraceJob):
        self.id = tj.id
        self.user = tj.user
        self.sla = tj.sla
        self.gpus = tj.gpus
        self.submit = tj.submit
        self.duration = tj.duration
        self.state = JobState.QUEUED
        self.placement: dict[str, tuple[int, ...]] = {}
        self.held = 0
        self.rem = tj.duration  # full-speed seconds left at t_ref
        self.t_ref = tj.submit
        self.stall_until = -math.inf
        self.attained = 0.0  # device-seconds held up to t_ref
        self.overhead_ds = 0.0  # device-seconds held while stalled, up to t_ref
        self.ran = 0.0  # seconds holding devices, up to t_ref
        self.start: Optional[float] = None
        self.finish: Optional[float] = None
        self.last_moved_at: Optional[float] = None
        self.last_checkpoint_at: Optional[float] = None
        self.version = 0
        self.view: Optional[JobView] = None
        #: the view's fields but service, until the job changes (None: to be rebuilt)
        self.fields: Optional[dict] = None

    def progress_to(self, t: float) -> tuple[float, float, float]:
        """(remaining work, attained, overhead) at time ``t`` without changing anything."""
        if not self.held or t <= self.t_ref:
            return self.rem, self.attained, self.overhead_ds
        dt = t - self.t_ref
        stalled = max(0.0, min(t, self.stall_until) - self.t_ref)
        rem = self.rem - (dt - stalled) * self.held / self.gpus
        return max(rem, 0.0), self.attained + self.held * dt, self.overhead_ds + self.held * stalled

    def materialize(self, t: float) -> None:
        if self.held and t > self.t_ref:
            self.ran += t - self.t_ref
        self.rem, self.attained, self.overhead_ds = self.progress_to(t)
        self.t_ref = t

    def ran_to(self, t: float) -> float:
        """Seconds spent holding devices up to ``t``."""
        return self.ran + (t - self.t_ref if self.held and t > self.t_ref else 0.0)

    def done_at(self) -> float:
        return max(self.t_ref, self.stall_until) + self.rem * self.gpus / self.held


class Simulator:
    """Replays ``jobs`` on ``gpus`` devices through ``policy``; ``run()`` returns the report."""

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        gpus: int,
        gpus_per_node: int = 8,
        overhead_s: float = 30.0,
        policy: Optional[Policy] = None,
        policy_name: str = "custom",
        seed: int = 0,
        quotas: Optional[Quotas] = None,
    ):
        if gpus <= 0 or gpus_per_node <= 0:
            raise ValueError("gpus and gpus_per_node must be positive")
        self.capacity = gpus
        self.per_node = gpus_per_node
        self.overhead_s = float(overhead_s)
        self.policy_name = policy_name
        self.seed = seed
        #: (user, tier) -> devices of that tier the user's jobs may hold (``quotas.py``); every
        #: snapshot carries them, as the live server's do
        self.quotas = dict(quotas or {})
        self.sizes: dict[str, int] = {}
        left = gpus
        i = 0
        while left > 0:
            self.sizes[f"node-{i}"] = min(gpus_per_node, left)
            left -= gpus_per_node
            i += 1
        self.max_size = max(self.sizes.values())
        self.owner: dict[str, dict[int, str]] = {n: {} for n in self.sizes}
        self._node_views: dict[str, NodeView] = {}
        self.trace = sorted(jobs, key=lambda j: (j.submit, j.id))
        self.rejected = [j for j in self.trace if j.gpus > gpus]
        self.trace = [j for j in self.trace if j.gpus <= gpus]
        self.active: dict[str, SimJob] = {}
        self.jobs: dict[str, SimJob] = {}
        self.finished: list[Finished] = []
        self.now = self.trace[0].submit if self.trace else 0.0
        self.allocated = 0
        self.allocated_ds = 0.0
        #: the arrival window (first to last submission): utilisation there is not diluted by
        #: the drain of the longest jobs after the last arrival
        self.window = (self.now, self.trace[-1].submit if self.trace else self.now)
        self.window_ds = 0.0
        self.counts = {"preempt": 0, "migrate": 0, "resize": 0, "resume": 0}
        self.rounds = 0
        self.policy_s = 0.0
        self._heap: list[tuple[float, int, int, str, int]] = []
        self._seq = 0
        self._wakes: set[float] = set()
        self.policy: Optional[Policy] = None
        self.wake_after_move_s: Optional[float] = None
        #: devices held per tier now, and (time, premium, standard, basic) after every round
        #: that changed them: the occupancy curves of ``--plot``
        self.by_tier = {SLA.PREMIUM: 0, SLA.STANDARD: 0, SLA.BASIC: 0}
        self.occupancy: list[tuple[float, int, int, int]] = []
        #: called as ``progress(jobs finished, jobs in the trace)`` after every round
        self.progress: Optional[Callable[[int, int], None]] = None
        if policy is not None:
            self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        """Use ``policy``; one with an anti-thrash interval gets a round when it expires."""
        self.policy = policy
        self.wake_after_move_s = getattr(policy, "min_move_interval_s", None)

    # ------------------------------------------------------------------ lookups for baselines

    def attained(self, job_id: str) -> float:
        """Device-seconds the job has held so far (Tiresias' attained service)."""
        return self.jobs[job_id].progress_to(self.now)[1]

    def remaining(self, job_id: str) -> float:
        """Run time left at full size (the SRTF oracle's knowledge)."""
        return self.jobs[job_id].progress_to(self.now)[0]

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimReport:
        if self.policy is None:
            raise ValueError("no policy")
        wall0 = time.perf_counter()
        cpu0 = time.process_time()  # on a shared machine the CPU time says more than the wall time
        trace, ai, n = self.trace, 0, len(self.trace)
        while True:
            t_arr = trace[ai].submit if ai < n else math.inf
            t_evt = self._next_event_time()
            t = min(t_arr, t_evt)
            if t == math.inf:
                break
            self._advance(t)
            while self._heap and self._heap[0][0] <= t:
                self._handle(heapq.heappop(self._heap))
            while ai < n and trace[ai].submit <= t:
                job = SimJob(trace[ai])
                self.active[job.id] = job
                self.jobs[job.id] = job
                ai += 1
            if self.active:
                self._round()
        self.occupancy.append((self.now, 0, 0, 0))
        if self.progress is not None:
            self.progress(len(self.finished), len(self.trace))
        if self.active:
            stuck = ", ".join(list(self.active)[:5])
            raise RuntimeError(f"simulation ended with {len(self.active)} jobs never finished ({stuck} ...)")
        overhead_ds = sum(j.overhead_ds for j in self.jobs.values())
        useful_ds = sum(j.gpus * j.duration for j in self.jobs.values())
        if not math.isclose(self.allocated_ds, useful_ds + overhead_ds, rel_tol=1e-6, abs_tol=1e-3):
            raise AssertionError(
                f"device-time not conserved: held {self.allocated_ds:.3f}, useful {useful_ds:.3f} + overhead {overhead_ds:.3f}"
            )
        report = summarize(
            self.finished,
            policy=self.policy_name,
            gpus=self.capacity,
            gpus_per_node=self.per_node,
            overhead_s=self.overhead_s,
            seed=self.seed,
            rejected=len(self.rejected),
            allocated_ds=self.allocated_ds,
            overhead_ds=overhead_ds,
            util_window=self.window_ds / (self.capacity * (self.window[1] - self.window[0]))
            if self.window[1] > self.window[0]
            else float("nan"),
            counts=self.counts,
            rounds=self.rounds,
            wall_s=time.perf_counter() - wall0,
            policy_s=self.policy_s,
        )
        report.extra["cpu_s"] = time.process_time() - cpu0
        return report

    def _next_event_time(self) -> float:
        heap = self._heap
        while heap:
            t, _, kind, job_id, version = heap[0]
            if kind == _WAKE:
                return t
            job = self.active.get(job_id)
            if job is not None and job.version == version:
                return t
            heapq.heappop(heap)  # stale: the job changed since this was scheduled
        return math.inf

    def _advance(self, t: float) -> None:
        if t < self.now:
            raise AssertionError(f"clock went back from {self.now} to {t}")
        self.allocated_ds += self.allocated * (t - self.now)
        if self.now < self.window[1]:
            self.window_ds += self.allocated * (min(t, self.window[1]) - self.now)
        self.now = t

    def _push(self, t: float, kind: int, job_id: str = "", version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, job_id, version))

    def _handle(self, event: tuple[float, int, int, str, int]) -> None:
        t, _, kind, job_id, version = event
        if kind == _WAKE:
            self._wakes.discard(t)
            return
        job = self.active.get(job_id)
        if job is None or job.version != version:
            return
        if kind == _STALL_END:
            if job.state in (JobState.RESIZING, JobState.MIGRATING):
                job.state = JobState.RUNNING
                job.view = job.fields = None
            return
        job.materialize(t)
        if job.rem > 1e-6 * max(1.0, job.duration):
            raise AssertionError(f"{job.id} completed with {job.rem} s of work left")
        self._release(job)
        job.state = JobState.SUCCEEDED
        job.finish = t
        del self.active[job.id]
        assert job.start is not None
        self.finished.append(Finished(job.gpus, str(job.sla), job.submit, job.start, t, job.duration))

    # ------------------------------------------------------------------ a round

    def snapshot(self) -> Snapshot:
        nodes = tuple(self._node_view(n) for n in self.sizes)
        # a job holding devices accrues attained service every second, so its view is rebuilt
        # each round; a waiting job's view stays valid until the job changes
        jobs = tuple(self._job_view(j) if j.held or j.view is None else j.view for j in self.active.values())
        return Snapshot(now=self.now, nodes=nodes, jobs=jobs, quotas=self.quotas)

    def _node_view(self, name: str) -> NodeView:
        v = self._node_views.get(name)
        if v is None:
            v = NodeView(name=name, devices=tuple(range(self.sizes[name])), used=dict(self.owner[name]))
            self._node_views[name] = v
        return v

    def _job_view(self, j: SimJob) -> JobView:
        # built without the frozen dataclass' __init__ (one object.__setattr__ per field): the
        # views of running jobs are rebuilt every round, and that was a fifth of a week's time.
        # Between two changes of the job only its service moves, so the other fields are kept
        # in ``j.fields`` and copied
        fields = j.fields
        if fields is None:
            fields = j.fields = dict(
                id=j.id,
                user=j.user,
                sla=j.sla,
                state=j.state,
                gpus=j.gpus,
                submitted_at=j.submit,
                placement=j.placement,
                last_checkpoint_at=j.last_checkpoint_at,
                last_moved_at=j.last_moved_at,
                elastic=True,
                attained_s=j.attained,
                ran_s=j.ran,
                nodes=None,
            )
        d = fields.copy()
        now = self.now
        if j.held and now > j.t_ref:  # as progress_to and ran_to
            dt = now - j.t_ref
            d["attained_s"] = j.attained + j.held * dt
            d["ran_s"] = j.ran + dt
        else:
            d["attained_s"] = j.attained
            d["ran_s"] = j.ran
        v = _new_view(JobView)
        _set_dict(v, "__dict__", d)
        j.view = v
        return v

    def _round(self) -> None:
        snap = self.snapshot()
        t0 = time.perf_counter()
        actions = self.policy(snap)  # type: ignore[misc]
        self.policy_s += time.perf_counter() - t0
        self.rounds += 1
        for a in actions:
            self._apply(a)
        b = self.by_tier
        sample = (self.now, b[SLA.PREMIUM], b[SLA.STANDARD], b[SLA.BASIC])
        if not self.occupancy or self.occupancy[-1][1:] != sample[1:]:
            self.occupancy.append(sample)
        if self.progress is not None:
            self.progress(len(self.finished), len(self.trace))
        if not 0 <= self.allocated <= self.capacity:
            raise AssertionError(f"{self.allocated} devices allocated of {self.capacity}")

    # ------------------------------------------------------------------ applying actions

    def _apply(self, a: Action) -> None:
        job = self.active.get(a.job_id)
        if job is None:
            raise InvalidAction(f"{type(a).__name__} for unknown or finished job {a.job_id}")
        t = self.now
        if isinstance(a, Place):
            if job.state not in (JobState.QUEUED, JobState.PREEMPTED):
                raise InvalidAction(f"Place for {job.id} in state {job.state}")
            self._check(job, a.placement)
            resumed = job.state == JobState.PREEMPTED
            job.t_ref = t
            self._acquire(job, a.placement)
            job.state = JobState.RUNNING
            if resumed:
                self.counts["resume"] += 1
                self._stall(job, t)
            if job.start is None:
                job.start = t
            job.last_checkpoint_at = t
            self._changed(job)
        elif isinstance(a, Preempt):
            if job.state != JobState.RUNNING:
                raise InvalidAction(f"Preempt for {job.id} in state {job.state}")
            job.materialize(t)
            self._release(job)
            job.state = JobState.PREEMPTED
            job.last_moved_at = t
            job.last_checkpoint_at = t
            self.counts["preempt"] += 1
            job.version += 1
            job.view = job.fields = None
            self._wake(t)
        elif isinstance(a, (Resize, Migrate)):
            if job.state != JobState.RUNNING:
                raise InvalidAction(f"{type(a).__name__} for {job.id} in state {job.state}")
            self._check(job, a.placement)
            job.materialize(t)
            self._release(job)
            self._acquire(job, a.placement)
            self.counts["resize" if isinstance(a, Resize) else "migrate"] += 1
            self._stall(job, t)
            if job.stall_until > t:  # in transition until the stall ends (a _STALL_END event)
                job.state = JobState.RESIZING if isinstance(a, Resize) else JobState.MIGRATING
            job.last_checkpoint_at = t
            self._changed(job)
        else:
            raise InvalidAction(f"unknown action {a!r}")

    def _stall(self, job: SimJob, t: float) -> None:
        job.stall_until = t + self.overhead_s
        job.last_moved_at = t
        self._wake(t)

    def _wake(self, t: float) -> None:
        if self.wake_after_move_s is None:
            return
        at = math.ceil((t + self.wake_after_move_s) / _WAKE_GRID_S) * _WAKE_GRID_S
        if at not in self._wakes:
            self._wakes.add(at)
            self._push(at, _WAKE)

    def _changed(self, job: SimJob) -> None:
        job.version += 1
        job.view = job.fields = None
        if job.stall_until > self.now:
            self._push(job.stall_until, _STALL_END, job.id, job.version)
        self._push(job.done_at(), _DONE, job.id, job.version)

    def _check(self, job: SimJob, placement: dict[str, tuple[int, ...]]) -> None:
        p = 0
        for node, devs in placement.items():
            size = self.sizes.get(node)
            if size is None:
                raise InvalidAction(f"{job.id}: no node {node}")
            if len(set(devs)) != len(devs):
                raise InvalidAction(f"{job.id}: duplicate devices on {node}: {devs}")
            owners = self.owner[node]
            for d in devs:
                if not 0 <= d < size:
                    raise InvalidAction(f"{job.id}: {node} has no device {d}")
                holder = owners.get(d)
                if holder is not None and holder != job.id:
                    raise InvalidAction(f"{job.id}: device {d} of {node} is held by {holder}")
            p += len(devs)
        if p < 1 or job.gpus % p:
            raise InvalidAction(f"{job.id}: {p} devices do not divide its world size {job.gpus}")
        if not fits_locality(placement, self.max_size, self.sizes):
            raise InvalidAction(f"{job.id}: placement {placement} breaks the locality rule")

    def _acquire(self, job: SimJob, placement: dict[str, tuple[int, ...]]) -> None:
        for node, devs in placement.items():
            owners = self.owner[node]
            for d in devs:
                owners[d] = job.id
            self._node_views.pop(node, None)
        job.placement = {n: tuple(d) for n, d in placement.items()}
        job.held = sum(len(d) for d in placement.values())
        self.allocated += job.held
        self.by_tier[job.sla] += job.held

    def _release(self, job: SimJob) -> None:
        for node, devs in job.placement.items():
            owners = self.owner[node]
            for d in devs:
                if owners.pop(d, None) != job.id:
                    raise AssertionError(f"{job.id} released device {d} of {node} it did not hold")
            self._node_views.pop(node, None)
        self.allocated -= job.held
        self.by_tier[job.sla] -= job.held
        job.placement = {}
        job.held = 0


# ---------------------------------------------------------------------- building and the CLI


def make_policy(name: str, sim: Simulator, overhead_s: float) -> Policy:
    """The named policy, wired to the simulator where it needs per-job knowledge."""
    if name == "singularity":
        return SingularityPolicy(PolicyConfig(overhead_s=overhead_s))
    if name == "fifo":
        return fifo_gang_policy
    if name == "fifo-backfill":
        return fifo_backfill_policy
    if name == "tiresias":
        return TiresiasPolicy(sim.attained)
    if name == "srtf":
        return SRTFPolicy(sim.remaining)
    if name == "srtf-premium":
        return PremiumFirstSRTFPolicy(sim.remaining)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def simulate(
    jobs: Sequence[TraceJob],
    policy: str = "singularity",
    gpus: int = 256,
    gpus_per_node: int = 8,
    overhead_s: float = 30.0,
    seed: int = 0,
    quotas: Optional[Quotas] = None,
) -> SimReport:
    """Run one named policy over ``jobs`` and return its report."""
    return run_policy(jobs, policy, gpus, gpus_per_node, overhead_s, seed, quotas=quotas)[0]


def run_policy(
    jobs: Sequence[TraceJob],
    policy: str,
    gpus: int = 256,
    gpus_per_node: int = 8,
    overhead_s: float = 30.0,
    seed: int = 0,
    progress: Optional[Callable[[int, int], None]] = None,
    quotas: Optional[Quotas] = None,
) -> tuple[SimReport, Simulator]:
    """Run one named policy; the report and the simulator (its finished jobs and occupancy)."""
    sim = Simulator(jobs, gpus, gpus_per_node, overhead_s, policy_name=policy, seed=seed, quotas=quotas)
    sim.set_policy(make_policy(policy, sim, overhead_s))
    sim.progress = progress
    return sim.run(), sim


def per_user_quotas(jobs: Sequence[TraceJob], gpus: int, fractions: dict[str, float]) -> dict[tuple[str, str], int]:
    """Every user of the trace gets ``fraction`` of the cluster's devices (at least one) of each
    tier named in ``fractions``: what an admin's tier quotas would be, for a simulated week."""
    users = sorted({j.user for j in jobs})
    return {(u, tier): max(1, int(gpus * f)) for tier, f in fractions.items() for u in users}


def tier_quota(text: str) -> tuple[str, float]:
    """``TIER=FRACTION`` of ``--tier-quota``: a tier that has one below it, a fraction in (0, 1]."""
    tier, _, value = text.partition("=")
    if tier not in ("premium", "standard"):
        raise argparse.ArgumentTypeError(f"{text!r}: the tier is premium or standard (a job over its quota "
                                         f"runs one tier down; basic has none below it)")
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: the fraction of the cluster's devices per user is in (0, 1],"
                                         f" e.g. {tier}=0.05")
    return tier, f


def _policy_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or text!r}; choose from {', '.join(POLICIES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``simulate`` arguments, for wiring into another command line as a subcommand."""
    parser.add_argument("trace", metavar="TRACE", help="CSV with submit_s,duration_s,num_gpus,vc")
    parser.add_argument("--gpus", type=int, default=256, help="devices in the cluster (default 256)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    parser.add_argument("--policy", type=_policy_list, default=["singularity"],
                        help=f"one or more, comma-separated: {', '.join(POLICIES)}")
    parser.add_argument("--overhead-s", type=float, default=30.0, help="cost of each preemption/migration/resize")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tier assignment")
    parser.add_argument("--tier-quota", type=tier_quota, action="append", default=[], metavar="TIER=FRACTION",
                        help="every user may hold this fraction of the devices in TIER (premium or standard);"
                             " jobs beyond it run one tier down (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the JCT CDF of each policy and the occupancy "
                                                          "per tier over time (needs matplotlib)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="show a progress bar (default: when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false")


def run_args(args: argparse.Namespace) -> int:
    from .progress import ProgressBar

    jobs = load_trace(args.trace, seed=args.seed)
    quotas = per_user_quotas(jobs, args.gpus, dict(args.tier_quota))
    show = sys.stderr.isatty() if args.progress is None else args.progress
    runs: list[tuple[SimReport, Simulator]] = []
    for name in args.policy:
        bar = ProgressBar(f"{name} on {args.gpus} GPUs", after_s=1.0 if args.progress is None else 0.0) \
            if show else None
        try:
            runs.append(run_policy(jobs, name, args.gpus, args.gpus_per_node, args.overhead_s, args.seed, bar,
                                   quotas))
        finally:
            if bar is not None:
                bar.close()
    if args.json:
        dicts = [_finite(r.to_dict()) for r, _ in runs]
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
    else:
        print("\n\n".join(format_report(r) for r, _ in runs))
    if args.plot:
        from .plot import plot_runs

        plot_runs([(r.policy, sim.finished, sim.occupancy, sim.capacity) for r, sim in runs], args.plot,
                  title=f"{Path(args.trace).name}, {args.gpus} GPUs, X = {args.overhead_s:g} s")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _finite(obj):
    """NaN (a tier with no jobs) becomes null, so that --json output is strict JSON."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``simulate TRACE [--gpus N] [--gpus-per-node 8] [--policy P[,P...]] [--overhead-s X] [--seed S]
    [--tier-quota TIER=FRACTION ...] [--json] [--plot FILE.png] [--progress | --no-progress]``."""
    parser = argparse.ArgumentParser(prog="simulate", description="Replay a job trace through a scheduling policy.")
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
