"""Which devices each logical rank of a job gets, for a placement of any size.

A job keeps its W ranks for life while the number of devices P under it changes. With P >= W
every rank gets P/W devices of its own; with P < W, S = W/P consecutive ranks share each device
(replica splicing), so co-located ranks are contiguous and the exact reduction can pre-reduce
them on their device. Pure functions: the service and its tests use them alike.
"""
from __future__ import annotations

from typing import Sequence

Device = tuple[str, int]  # (node, device index)


def fits(world: int, devices: int) -> bool:
    """Whether W ranks can run on ``devices`` devices: one divides the other."""
    return devices >= 1 and (devices % world == 0 or world % devices == 0)


def choices(world: int, limit: int) -> list[int]:
    """Device counts a job of ``world`` ranks may be resized to (it keeps its ranks and each rank
    keeps seeing one device, so: the divisors of W, up to ``limit``)."""
    return [p for p in range(1, min(world, limit) + 1) if world % p == 0]


def elastic(world: int, gpus: int) -> bool:
    """Whether the scheduler may run the job on fewer devices than it asked for: every divisor
    of its request must be a size its ranks fit (one device per rank at most)."""
    return world > 1 and world >= gpus and world % gpus == 0


def assign(world: int, flat: Sequence[Device]) -> list[list[Device]]:
    """Devices of each rank, taking ``flat`` (the placement's devices, node by node) in order."""
    p = len(flat)
    if not fits(world, p):
        raise ValueError(f"{world} ranks cannot be spread evenly over {p} devices")
    if p >= world:
        per = p // world
        return [list(flat[r * per:(r + 1) * per]) for r in range(world)]
    share = world // p
    return [[flat[r // share]] for r in range(world)]


def layout(per_rank: Sequence[Sequence[Device]]) -> str:
    """``SINGULARITY_PLACEMENT`` text: ranks grouped by the devices they share, in placement order."""
    slots: dict[tuple[Device, ...], list[int]] = {}
    for rank, devices in enumerate(per_rank):
        slots.setdefault(tuple(devices), []).append(rank)
    return "|".join(",".join(str(r) for r in ranks) for ranks in slots.values())
