"""The layout of a job's ranks: which logical ranks share a slot (a device, or a CPU slot), in what order.

A job keeps its logical world size W for life; the placement maps its W ranks onto P slots
(P divides W in the scheduler's plans, though nothing here needs it).  The text form, carried in
``SINGULARITY_PLACEMENT``, lists the slots separated by ``|`` and each slot's ranks separated by
commas: ``"0,1|2,3"`` is two slots of two ranks (S = 2).  The order of the text is the *physical*
order: it numbers the ranks of the transport groups (gloo, NCCL), as a topology-aware launcher
would.  Logical ranks are what the user's code and the reduction order see.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from backend.contract import ENV_PLACEMENT


@dataclass(frozen=True)
class RankLayout:
    """Slots of logical ranks, in physical order."""

    slots: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ranks = [r for slot in self.slots for r in slot]
        if not self.slots or any(not s for s in self.slots):
            raise ValueError(f"placement {self.text()!r}: every slot needs at least one rank")
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"placement {self.text()!r} must list every rank 0..{len(ranks) - 1} exactly once")

    # ------------------------------------------------------------------ construction
    @classmethod
    def parse(cls, text: str) -> "RankLayout":
        try:
            slots = tuple(tuple(int(r) for r in part.split(",")) for part in text.strip().split("|"))
        except ValueError:
            raise ValueError(f"placement {text!r}: expected slots like '0,1|2,3'") from None
        return cls(slots)

    @classmethod
    def one_per_slot(cls, world_size: int) -> "RankLayout":
        return cls(tuple((r,) for r in range(world_size)))

    @classmethod
    def contiguous(cls, world_size: int, per_slot: int) -> "RankLayout":
        """``per_slot`` consecutive ranks per slot: the scheduler's default for P = W / S."""
        if per_slot < 1 or world_size % per_slot:
            raise ValueError(f"{per_slot} ranks per slot does not divide world size {world_size}")
        return cls(tuple(tuple(range(s, s + per_slot)) for s in range(0, world_size, per_slot)))

    @classmethod
    def from_env(cls, world_size: int, env: Optional[dict] = None) -> "RankLayout":
        text = (env if env is not None else os.environ).get(ENV_PLACEMENT, "").strip()
        placement = cls.parse(text) if text else cls.one_per_slot(world_size)
        if placement.world_size != world_size:
            raise ValueError(f"{ENV_PLACEMENT}={text!r} places {placement.world_size} ranks, "
                             f"but the world size is {world_size}")
        return placement

    def text(self) -> str:
        return "|".join(",".join(str(r) for r in slot) for slot in self.slots)

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.slots)

    @property
    def order(self) -> list[int]:
        """Logical ranks in physical order (physical rank p runs logical rank order[p])."""
        return [r for slot in self.slots for r in slot]

    def physical(self, logical: int) -> int:
        return self.order.index(logical)

    def slot_of(self, logical: int) -> int:
        return next(i for i, s in enumerate(self.slots) if logical in s)

    @property
    def max_per_slot(self) -> int:
        return max(len(s) for s in self.slots)

    def restrict(self, members: Sequence[int]) -> "RankLayout":
        """The placement of a subgroup: ``members`` are global ranks, group rank i is members[i]."""
        index = {g: i for i, g in enumerate(members)}
        slots = tuple(tuple(index[r] for r in slot if r in index) for slot in self.slots)
        return RankLayout(tuple(s for s in slots if s))

    def splits(self, members: Sequence[int]) -> list[tuple[int, ...]]:
        """Slots of several ranks that ``members`` (a subgroup's global ranks) only partly contain."""
        inside = set(members)
        return [slot for slot in self.slots if len(slot) > 1 and 0 < len(inside.intersection(slot)) < len(slot)]

    def local_env(self, logical: int) -> dict[str, str]:
        """torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE for ranks that all run on this machine.

        They number the job's processes on the machine (code relies on "local rank 0" existing
        once per node, e.g. to download a data set), not its slots: a resize changes the slots,
        never the ranks. (The service's GPU ranks get 0 and 1 instead: each sees its one device
        as ``cuda:0``.)
        """
        self.slot_of(logical)  # validates the rank
        return {"LOCAL_RANK": str(logical), "LOCAL_WORLD_SIZE": str(self.world_size)}
