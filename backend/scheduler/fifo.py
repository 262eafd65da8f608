"""Scheduler v0: first come, first served, all ranks at once, one node when it fits.

Strict FIFO: a job that cannot be placed blocks those behind it, so a large job is never
starved by a stream of small ones. Better policies replace this function, not the plumbing.
"""
from __future__ import annotations

from .types import Action, NodeView, Place, Snapshot


def pick_devices(nodes: list[NodeView], free: dict[str, list[int]], gpus: int) -> dict[str, tuple[int, ...]] | None:
    # Best fit on a single node: the node with the fewest free devices that still fits,
    # which keeps large holes open for large jobs.
    fitting = [n for n in nodes if len(free[n.name]) >= gpus]
    if fitting:
        best = min(fitting, key=lambda n: (len(free[n.name]), n.name))
        return {best.name: tuple(free[best.name][:gpus])}
    # Otherwise span nodes, fullest-free first, so the job touches as few nodes as possible.
    if sum(len(v) for v in free.values()) < gpus:
        return None
    placement: dict[str, tuple[int, ...]] = {}
    need = gpus
    for n in sorted(nodes, key=lambda n: (-len(free[n.name]), n.name)):
        take = free[n.name][:need]
        if take:
            placement[n.name] = tuple(take)
            need -= len(take)
        if need == 0:
            return placement
    return None


def fifo_policy(snapshot: Snapshot) -> list[Action]:
    nodes = [n for n in snapshot.nodes if n.schedulable]
    free = {n.name: list(n.free) for n in nodes}
    actions: list[Action] = []
    for job in snapshot.queued():
        allowed = nodes if job.nodes is None else [n for n in nodes if n.name in job.nodes]
        placement = pick_devices(allowed, free, job.gpus)
        if placement is None:
            break  # strict FIFO: nothing overtakes the head of the queue
        for node, devs in placement.items():
            free[node] = [d for d in free[node] if d not in devs]
        where = ", ".join(f"{n} {list(d)}" for n, d in placement.items())
        actions.append(Place(job.id, placement, reason=f"fifo: first in queue, fits on {where}"))
    return actions
