"""Gang placement on a map of free devices: the one rule for which devices a job gets, shared by
every policy (so that all play by one rule) and by the server's migrate, resize and drain.

Locality rule (the same for the Singularity policy and every baseline, live and simulated):

- a job on P devices with P <= D, the size of the largest node, runs on ONE node, because its
  ranks exchange gradients every step and a node's interconnect is much faster than the network;
- a larger job takes whole free nodes, largest first, until at most D devices remain, and puts
  the remainder on one more node (best fit).

Within those rules the choice is best fit: the node with the fewest free devices that still
fits, which keeps large holes open for large jobs. Free devices are kept in buckets by count so
that best fit costs O(D) per job and not O(nodes): a round over 1,000 nodes stays cheap.

A job limited to some nodes (``only``: where its checkpoint resumes exactly; ``exclude``: the
nodes a migration leaves) plays by the same rule over those nodes, D being the largest of them.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Optional

from .types import NodeView

#: node name -> the device indices a job holds (or is given) there; the SDK's `Placement`
#: rows are its wire form
DeviceMap = dict[str, tuple[int, ...]]


@lru_cache(maxsize=4096)
def divisors(w: int) -> tuple[int, ...]:
    """Divisors of the logical world size, largest first: the device counts a job may run on."""
    return tuple(p for p in range(w, 0, -1) if w % p == 0)


def fmt_placement(placement: DeviceMap) -> str:
    """Short human form used in reasons: ``node-1 [0, 1], node-2 [4]``."""
    return ", ".join(f"{n} {list(d)}" for n, d in placement.items())


class FreeDevices:
    """Mutable index of the free devices of the schedulable nodes.

    ``take``/``give`` keep per-node sorted free lists and buckets (free count -> nodes) in step.
    The buckets are insertion-ordered dicts, so every choice is deterministic for a given
    sequence of operations, which keeps simulations reproducible.
    """

    def __init__(self, nodes: Iterable[NodeView]):
        self.size: dict[str, int] = {}
        self.free: dict[str, list[int]] = {}
        for n in nodes:
            if not n.schedulable:
                continue
            self.size[n.name] = len(n.devices)
            used = n.used
            self.free[n.name] = sorted(d for d in n.devices if d not in used)
        self.max_size = max(self.size.values(), default=0)
        self.buckets: list[dict[str, None]] = [dict() for _ in range(self.max_size + 1)]
        self.total = 0
        for name, devs in self.free.items():
            self.buckets[len(devs)][name] = None
            self.total += len(devs)
        self.capacity = sum(self.size.values())

    def count(self, node: str) -> int:
        devs = self.free.get(node)
        return len(devs) if devs is not None else 0

    def take(self, node: str, devs: Iterable[int]) -> None:
        """Mark ``devs`` of ``node`` as used; every one of them must be free."""
        cur = self.free[node]
        remove = set(devs)
        before = len(cur)
        rest = [d for d in cur if d not in remove]
        if before - len(rest) != len(remove):
            raise ValueError(f"devices {sorted(remove)} of {node} are not all free")
        self._move(node, before, rest)

    def give(self, node: str, devs: Iterable[int]) -> None:
        """Return ``devs`` of ``node`` to the free pool (ignored for unschedulable nodes)."""
        cur = self.free.get(node)
        if cur is None:
            return
        add = set(devs)
        if add & set(cur):
            raise ValueError(f"devices {sorted(add & set(cur))} of {node} are already free")
        self._move(node, len(cur), sorted(cur + list(add)))

    def _move(self, node: str, before: int, now: list[int]) -> None:
        del self.buckets[before][node]
        self.free[node] = now
        self.buckets[len(now)][node] = None
        self.total += len(now) - before

    def best_fit(self, k: int, exclude: frozenset[str] | set[str] = frozenset(),
                 among: Optional[frozenset[str]] = None) -> Optional[str]:
        """The node with the fewest free devices that still has ``k`` free, or None; only one of
        ``among`` when given."""
        for c in range(max(k, 0), self.max_size + 1):
            for name in self.buckets[c]:
                if name not in exclude and (among is None or name in among):
                    return name
        return None

    def fully_free(self, among: Optional[frozenset[str]] = None) -> list[str]:
        """Nodes with every device free, largest first; only those of ``among`` when given."""
        out = [n for c in range(self.max_size, 0, -1) for n in self.buckets[c]
               if c == self.size[n] and (among is None or n in among)]
        return out

    def pick(self, p: int, prefer: Iterable[str] = (), only: Optional[frozenset[str]] = None,
             exclude: Iterable[str] = ()) -> Optional[DeviceMap]:
        """Devices for a gang of ``p`` under the locality rule, or None if it does not fit now.

        The one rule for device choice: every policy, and the server's migrate, resize and
        drain, place through it. First a filter, then a score:

        - filter: the schedulable nodes, only those of ``only`` when given (where the job's
          checkpoint resumes exactly), none of ``exclude`` (the nodes a migration leaves);
          D is the size of the largest node that passes;
        - score: P <= D runs on one node: a node of ``prefer`` first (in order; a growing job
          keeps its node), else best fit; P > D takes whole free nodes, largest first, until at
          most D remain, and best fit for the remainder.
        """
        among = None
        total, largest = self.total, self.max_size
        if only is not None or exclude:
            gone = set(exclude)
            among = frozenset(n for n in (self.free if only is None else only) if n in self.free and n not in gone)
            total = sum(len(self.free[n]) for n in among)
            largest = max((self.size[n] for n in among), default=0)
        if p <= 0 or p > total:
            return None
        if p <= largest:
            for name in prefer:
                if (among is None or name in among) and self.count(name) >= p:
                    return {name: tuple(self.free[name][:p])}
            node = self.best_fit(p, among=among)
            return None if node is None else {node: tuple(self.free[node][:p])}
        placement: DeviceMap = {}
        need = p
        for name in self.fully_free(among):
            if need <= largest:
                break
            placement[name] = tuple(self.free[name])
            need -= len(placement[name])
        if need > largest:
            return None
        last = self.best_fit(need, exclude=set(placement), among=among)
        if last is None:
            return None
        placement[last] = tuple(self.free[last][:need])
        return placement

    def take_placement(self, placement: DeviceMap) -> None:
        for node, devs in placement.items():
            self.take(node, devs)

    def give_placement(self, placement: DeviceMap) -> None:
        for node, devs in placement.items():
            self.give(node, devs)


def fits_locality(placement: DeviceMap, max_size: int, sizes: dict[str, int]) -> bool:
    """True if ``placement`` obeys the locality rule (used by the simulator to check policies)."""
    p = sum(len(d) for d in placement.values())
    if p <= max_size:
        return len(placement) == 1
    partial = [n for n, d in placement.items() if len(d) < sizes.get(n, 0)]
    return len(partial) <= 1
