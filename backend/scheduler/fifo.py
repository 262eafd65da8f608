"""Scheduler v0: first come, first served, all ranks at once, on devices chosen by the shared
locality rule (``placement.py``).

Strict FIFO: a job that cannot be placed blocks those behind it, so a large job is never
starved by a stream of small ones. Better policies replace this function, not the plumbing.
"""
from __future__ import annotations

from .placement import FreeDevices, fmt_placement
from .types import Action, Place, Snapshot


def fifo_policy(snapshot: Snapshot) -> list[Action]:
    free = FreeDevices(snapshot.nodes)
    actions: list[Action] = []
    for job in snapshot.queued():
        placement = free.pick(job.gpus, only=job.nodes)
        if placement is None:
            break  # strict FIFO: nothing overtakes the head of the queue
        free.take_placement(placement)
        actions.append(Place(job.id, placement, reason=f"fifo: first in queue, fits on {fmt_placement(placement)}"))
    return actions
