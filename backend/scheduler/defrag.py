"""Defragmentation: migrate small jobs off one node so that a waiting job fits on it.

Used when enough devices are free in the cluster but no single node has ``p`` of them. A move
costs the moved jobs ``overhead_s`` each on every device they hold; the gain is the waiting
job's ``p`` devices running instead of idling until the node frees up on its own. We do not
know when that will be, so the estimate is the age of the jobs we would move (a job that has
been in the system for t seconds is, on heavy-tailed traces, likely to stay about as long
again). The move happens when gain > ``defrag_margin`` x cost. Premium jobs are never moved,
and a job is moved only for a job of its own tier or a higher one.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .placement import DeviceMap
from .round_state import RJob, RoundState


def _choose_movers(movers: list[RJob], need: int) -> list[RJob]:
    """Fewest devices that cover ``need``: one job if one is big enough, else smallest first."""
    movers = sorted(movers, key=lambda j: (j.held, j.victim_key))
    for j in movers:
        if j.held >= need:
            return [j]
    out: list[RJob] = []
    got = 0
    for j in movers:
        out.append(j)
        got += j.held
        if got >= need:
            return out
    return []


def defragment(
    state: RoundState, ben: RJob, p: int, node_index: Optional[int] = None, gain: Optional[float] = None
) -> Optional[DeviceMap]:
    """Migrate jobs so that ``ben`` fits on one node with ``p`` devices; the placement or None.

    ``node_index``: only that node (a shrunk job growing where it runs). ``gain``: the
    expected gain in device-seconds, instead of the waiting job's estimate."""
    cfg = state.config
    if not cfg.defrag or p > state.free.max_size or state.free.total < p:
        return None
    need = p - state.nfree
    movable = state.cats.sum(axis=0)
    ok = (need > 0) & (state.size >= p) & (need <= movable)
    if node_index is not None:
        ok &= np.arange(len(ok)) == node_index
    cand = np.flatnonzero(ok)
    if len(cand) == 0:
        return None
    cand = cand[np.lexsort((cand, need[cand]))][:4]
    for i in (int(x) for x in cand):
        node = state.names[i]
        k = int(need[i])
        movers = [
            j
            for j in state.node_jobs.get(i, ())
            if j.movable and j.rank <= ben.rank and len(j.placement) == 1 and node in j.placement
        ]
        moved = _choose_movers(movers, k)
        if not moved:
            continue
        cost = cfg.overhead_s * sum(j.held for j in moved)
        if gain is None:
            if p * max(state.now - j.submitted_at for j in moved) <= cfg.defrag_margin * cost:
                continue
        elif gain <= cfg.defrag_margin * cost:
            continue
        dests = _destinations(state, moved, node)
        if dests is None:
            continue
        for j, dest in dests:
            state.migrate(
                j,
                dest,
                f"migrated {node}->{next(iter(dest))}: frees {node} so that {ben.sla} job {ben.id}"
                f" can {'start on' if gain is None else 'grow to'} {p} devices there (defragmentation)",
            )
        return {node: tuple(state.free.free[node][:p])}
    return None


def _destinations(state: RoundState, moved: list[RJob], away: str) -> Optional[list[tuple[RJob, DeviceMap]]]:
    """Best-fit homes for the moved jobs on other nodes, or None; leaves the state unchanged."""
    taken: list[DeviceMap] = []
    out: list[tuple[RJob, DeviceMap]] = []
    try:
        for j in sorted(moved, key=lambda j: -j.held):
            dest = state.free.best_fit(j.held, exclude={away})
            if dest is None:
                return None
            pl = {dest: tuple(state.free.free[dest][: j.held])}
            state.take_devices(pl)
            taken.append(pl)
            out.append((j, pl))
    finally:
        for pl in taken:
            state.give_devices(pl)
    return out
