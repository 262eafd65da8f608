"""Hand-made snapshots for policy tests, and a checker that applies actions to a device map."""
from __future__ import annotations

from typing import Iterable, Optional

from backend.scheduler.types import Action, JobView, Migrate, NodeView, Place, Preempt, Resize, Snapshot
from singularity_sdk.protocol import SLA, JobState

P, S, B = SLA.PREMIUM, SLA.STANDARD, SLA.BASIC


def running(
    job_id: str,
    sla: SLA,
    gpus: int,
    placement: dict[str, tuple[int, ...]],
    user: str = "u",
    submitted_at: float = 0.0,
    ckpt: Optional[float] = None,
    moved: Optional[float] = None,
    state: JobState = JobState.RUNNING,
    attained: float = 0.0,
    ran: Optional[float] = None,
) -> JobView:
    return JobView(
        id=job_id, user=user, sla=sla, state=state, gpus=gpus, submitted_at=submitted_at,
        placement=placement, last_checkpoint_at=ckpt, last_moved_at=moved, attained_s=attained, ran_s=ran,
    )


def waiting(
    job_id: str,
    sla: SLA,
    gpus: int,
    user: str = "u",
    submitted_at: float = 0.0,
    state: JobState = JobState.QUEUED,
    attained: float = 0.0,
    ran: Optional[float] = None,
) -> JobView:
    return JobView(
        id=job_id, user=user, sla=sla, state=state, gpus=gpus, submitted_at=submitted_at, attained_s=attained, ran_s=ran
    )


def snapshot(now: float, nodes: dict[str, int], jobs: Iterable[JobView]) -> Snapshot:
    """Nodes by name -> device count; which devices are used follows from the jobs."""
    jobs = tuple(jobs)
    used: dict[str, dict[int, str]] = {n: {} for n in nodes}
    for j in jobs:
        for n, devs in j.placement.items():
            for d in devs:
                assert d not in used[n], f"test bug: device {d} of {n} given twice"
                used[n][d] = j.id
    views = tuple(NodeView(n, tuple(range(k)), used=used[n]) for n, k in nodes.items())
    return Snapshot(now=now, nodes=views, jobs=jobs)


def apply(snap: Snapshot, actions: list[Action]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Apply actions in order to the snapshot's devices; fail on any double booking.

    Returns job id -> placement afterwards (empty for preempted or waiting jobs).
    """
    jobs = {j.id: j for j in snap.jobs}
    state = {j.id: j.state for j in snap.jobs}
    where = {j.id: dict(j.placement) for j in snap.jobs}
    owner = {(n.name, d): j for n in snap.nodes for d, j in n.used.items()}
    sizes = {n.name: len(n.devices) for n in snap.nodes}
    for a in actions:
        job = jobs[a.job_id]
        if isinstance(a, (Preempt, Migrate, Resize)):
            assert state[a.job_id] == JobState.RUNNING, a
        for n, devs in where[a.job_id].items():
            for d in devs:
                del owner[(n, d)]
        if isinstance(a, Preempt):
            where[a.job_id] = {}
            state[a.job_id] = JobState.PREEMPTED
            continue
        assert isinstance(a, (Place, Migrate, Resize)), a
        if isinstance(a, Place):
            assert state[a.job_id] in (JobState.QUEUED, JobState.PREEMPTED), a
        state[a.job_id] = JobState.RUNNING
        p = sum(len(d) for d in a.placement.values())
        assert p >= 1 and job.gpus % p == 0, f"{a.job_id}: {p} devices for W={job.gpus}"
        for n, devs in a.placement.items():
            for d in devs:
                assert 0 <= d < sizes[n]
                assert (n, d) not in owner, f"{a.job_id} given {n}:{d} held by {owner[(n, d)]}"
                owner[(n, d)] = a.job_id
        where[a.job_id] = dict(a.placement)
        assert a.reason, f"action without a reason: {a}"
    return where


def by_job(actions: list[Action]) -> dict[str, Action]:
    """Job id -> its action; a job gets one action, or a Preempt then a Place (displaced)."""
    out: dict[str, Action] = {}
    for a in actions:
        prev = out.get(a.job_id)
        assert prev is None or (isinstance(prev, Preempt) and isinstance(a, Place)), f"two actions for {a.job_id}"
        out[a.job_id] = a
    return out


def ndev(placement: dict[str, tuple[int, ...]]) -> int:
    return sum(len(d) for d in placement.values())
