"""Per-user device quotas per tier: a tier is a shared resource, not a label anyone may claim.

An admin gives each user at most so many devices of a tier (``Snapshot.quotas``: (user, tier)
-> devices; a tier without an entry is unlimited for that user). A job whose tier would take
its user past the quota runs one tier down, premium as standard and standard as basic, for
this round: the round reads it that way, so it may be shrunk and preempted like any job of
that tier. Running jobs count first (oldest first), then waiting ones (oldest first), so a job
that started within its user's quota keeps its tier while newer ones queue behind the limit.
"""
from __future__ import annotations

from typing import Mapping

from singularity_sdk.protocol import SLA

from .types import JobView

#: the tier a job runs at when its own is over quota
DOWN = {SLA.PREMIUM: SLA.STANDARD, SLA.STANDARD: SLA.BASIC}
Quotas = Mapping[tuple[str, str], int]


def over_quota(jobs: tuple[JobView, ...], quotas: Quotas) -> dict[str, SLA]:
    """Job id -> the tier it runs at this round, for the jobs whose user is over its quota."""
    if not quotas:
        return {}
    mine = [j for j in jobs if (j.user, str(j.sla)) in quotas]
    mine.sort(key=lambda j: (not j.placement, j.submitted_at, j.id))
    used: dict[tuple[str, str], int] = {}
    out: dict[str, SLA] = {}
    for j in mine:
        key = (j.user, str(j.sla))
        n = used.get(key, 0) + j.gpus
        if n > quotas[key] and j.sla in DOWN:
            out[j.id] = DOWN[j.sla]
        else:
            used[key] = n
    return out
