"""Taking devices back from running jobs for a waiting one, at least cost.

Costs, cheapest first: shrink a basic job, preempt a basic job, shrink a standard job, preempt a
standard job (premium work only). Within a kind, the job that loses least work goes first
(newest checkpoint), then the newest job. Premium jobs and jobs moved recently are never taken
from. Plans are computed first and applied only when the whole gang fits, so a failed attempt
changes nothing.

Jobs of the waiting job's own tier are taken from in one of two modes: fair share (a standard
job shrinks standard jobs of users holding more devices than its user) or least attained
service (``las``: jobs at least ``las_take_gap`` service classes above the waiting job's;
standard ones are only shrunk, because the categories passed for standard work never include
preempting standard jobs).
"""
from __future__ import annotations

from typing import Optional

from singularity_sdk.protocol import SLA

from .placement import DeviceMap, divisors
from .round_state import CATEGORY, RJob, RoundState, shrunk_placement

Changes = dict[RJob, int]  # victim -> new device count (0 = preempt)


def _freed_on(job: RJob, node: str, p: int) -> int:
    """Devices ``job`` hands back on ``node`` when it shrinks to ``p``."""
    keep = shrunk_placement(job.placement, p)
    return len(job.placement[node]) - len(keep.get(node, ()))


def _least_shrink(job: RJob, node: str, need: int) -> tuple[int, int]:
    """The smallest shrink of ``job`` that frees ``need`` devices on ``node`` (or its most)."""
    best = (job.held, 0)
    for p in divisors(job.gpus):
        if p >= job.held or p < job.min_p:
            continue
        freed = _freed_on(job, node, p)
        best = (p, freed)
        if freed >= need:
            break
    return best


def plan_node(
    state: RoundState,
    i: int,
    need: int,
    cats: tuple[int, ...],
    ben: RJob,
    p: int,
    taken: set[RJob],
    las: Optional[tuple[int, int]] = None,
) -> Optional[Changes]:
    """Victims on node ``i`` that free ``need`` devices through ``cats``, or None.

    A job of the waiting job's own tier is a victim only if its user holds more devices of the
    tier than the waiting job's user will once it runs (fair share), or, with ``las``, only if
    its service class is ``las_take_gap`` or more above the waiting job's (least attained
    service).
    """
    node = state.names[i]
    hb = state.held(ben.rank, ben.user) + p
    lower_min = _lower_min(state, ben)
    by_rank: dict[int, list[RJob]] = {0: [], 1: []}
    for j in state.node_jobs.get(i, ()):
        if not j.movable or j in taken or node not in j.placement:
            continue
        if j.rank < ben.rank and j.las_victim < lower_min:
            continue
        if las is not None and j.rank >= ben.rank:
            if j.las_victim < las[1] + state.config.las_take_gap:
                continue
        elif j.rank == ben.rank and state.held(j.rank, j.user) <= hb:
            continue
        by_rank[j.rank].append(j)
    for lst in by_rank.values():
        lst.sort(key=lambda j: j.victim_key)

    changes: Changes = {}
    rem = need
    for c in cats:
        rank, kind = CATEGORY[c]
        for j in by_rank[rank]:
            if rem <= 0:
                break
            if kind == "shrink":
                new_p, freed = _least_shrink(j, node, rem)
                if freed > 0:
                    changes[j] = new_p
                    rem -= freed
            else:
                before = _freed_on(j, node, changes[j]) if j in changes else 0
                changes[j] = 0
                rem -= len(j.placement[node]) - before
        if rem <= 0:
            break
    if rem > 0:
        return None
    # Second pass: the preemptions are fixed; shrink the rest only as far as still needed.
    final: Changes = {j: 0 for j, q in changes.items() if q == 0}
    rem = need - sum(len(j.placement[node]) for j in final)
    for c in cats:
        rank, kind = CATEGORY[c]
        if kind != "shrink":
            continue
        for j in by_rank[rank]:
            if rem <= 0 or j in final:
                continue
            new_p, freed = _least_shrink(j, node, rem)
            if freed > 0:
                final[j] = new_p
                rem -= freed
    return final if rem <= 0 else changes


def _lower_min(state: RoundState, ben: RJob) -> int:
    """Least victim class of the basic jobs standard work may take from by the tier order (a
    basic job aged into standard may take from any: that is how it stops starving)."""
    return state.config.tier_take_min_class if ben.rank == 1 and ben.view.sla != SLA.BASIC else 0


def _commit(state: RoundState, node: str, changes: Changes, ben: RJob, p: int, las: bool = False) -> None:
    for j in sorted(changes, key=lambda j: (j.rank, j.victim_key)):
        q = changes[j]
        why = f"{ben.sla} job {ben.id} needs {p} devices on {node}"
        extra = ""
        if j.rank >= ben.rank:
            if las:
                extra = (
                    f"; least attained service first in the {j.sla} tier: {j.id} has had"
                    f" {j.attained / 3600:.2f} device-hours, {ben.id} {ben.attained / 3600:.2f}"
                )
            else:
                extra = (
                    f"; fair share in {j.sla} tier: user {j.user} holds {state.held(j.rank, j.user)} devices,"
                    f" user {ben.user} {state.held(ben.rank, ben.user)}"
                )
        if q == 0:
            state.preempt(j, f"preempted: {why}{extra}; shrinking {j.sla} jobs there was not enough")
            continue
        state.resize(
            j,
            shrunk_placement(j.placement, q),
            f"shrunk {j.held}->{q} of {j.gpus} devices (spliced, keeps running): {why}{extra}",
        )


def reclaim(state: RoundState, ben: RJob, p: int, cats: tuple[int, ...], las: bool = False) -> Optional[DeviceMap]:
    """Free ``p`` devices for ``ben`` by taking them from running jobs; the placement, or None.

    ``las``: jobs of ``ben``'s own tier are taken from by least attained service (only those
    ``las_take_gap`` or more service classes above ``ben``), not by fair share."""
    big = state.free.max_size
    key = (ben.rank, ben.las) if las else None
    if p <= big:
        for i in state.reclaim_candidates(p, cats, limit=4, las=key, lower_min=_lower_min(state, ben)):
            changes = plan_node(state, i, p - int(state.nfree[i]), cats, ben, p, set(), key)
            if changes is None:
                continue
            node = state.names[i]
            _commit(state, node, changes, ben, p, las)
            return {node: _devices(state, node, p)}
        return None
    return _reclaim_multi(state, ben, p, cats, key)


def _reclaim_multi(
    state: RoundState, ben: RJob, p: int, cats: tuple[int, ...], las: Optional[tuple[int, int]] = None
) -> Optional[DeviceMap]:
    """A job larger than a node: whole nodes plus a remainder, each freed like a small job."""
    big = state.free.max_size
    whole_n, rest = divmod(p, big)
    plans: list[tuple[int, Changes]] = []
    used: set[int] = set()
    taken: set[RJob] = set()
    fully = [state.index[n] for n in state.free.fully_free() if state.free.size[n] == big]
    for _ in range(whole_n):
        spare = [i for i in fully if i not in used]
        if spare:
            plans.append((spare[0], {}))
            used.add(spare[0])
            continue
        for i in state.reclaim_candidates(big, cats, limit=4, whole=True, exclude=frozenset(used), las=las,
                                          lower_min=_lower_min(state, ben)):
            changes = plan_node(state, i, big - int(state.nfree[i]), cats, ben, p, taken, las)
            if changes is not None:
                plans.append((i, changes))
                used.add(i)
                taken.update(changes)
                break
        else:
            return None
    if rest:
        node = state.free.best_fit(rest, exclude={state.names[i] for i in used})
        if node is not None:
            plans.append((state.index[node], {}))
        else:
            for i in state.reclaim_candidates(rest, cats, limit=4, exclude=frozenset(used), las=las,
                                              lower_min=_lower_min(state, ben)):
                changes = plan_node(state, i, rest - int(state.nfree[i]), cats, ben, p, taken, las)
                if changes is not None:
                    plans.append((i, changes))
                    break
            else:
                return None
    placement: DeviceMap = {}
    for k, (i, changes) in enumerate(plans):
        node = state.names[i]
        _commit(state, node, changes, ben, p, las is not None)
        want = rest if (rest and k == len(plans) - 1) else big
        placement[node] = _devices(state, node, want)
    return placement


def _devices(state: RoundState, node: str, k: int) -> tuple[int, ...]:
    devs = tuple(state.free.free[node][:k])
    if len(devs) != k:  # a plan freed less than it promised: a bug, not a scheduling outcome
        raise AssertionError(f"reclaim on {node} left {len(devs)} free devices, needed {k}")
    return devs

