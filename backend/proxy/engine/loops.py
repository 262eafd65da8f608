"""The frames of the loops and blocks a running program is in: its stack *is* its position.

The hot path is `ForFrame.__next__` / `WhileFrame.tick`: one counter increment, one step
increment and one plain attribute test (``controller.flag``); only when another thread raised
that flag does the loop call its host's `safe_point`.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

from . import iterators


class _Flagged(Protocol):
    flag: bool


class LoopHost(Protocol):
    """What a loop frame needs of the runtime that runs it."""

    ctl: _Flagged
    step: int
    stack: list
    preempted_exc: Optional[BaseException]

    def safe_point(self, boundary: Optional[int]) -> None: ...


class ForFrame:
    """A running ``for`` loop: counts fetched items; its ``__next__`` is the safe point."""

    __slots__ = ("rt", "ctl", "node", "it", "source", "desc", "fetched", "current", "pending", "digests", "extra")
    kind = "for"

    def __init__(self, rt: LoopHost, node: int, it: Iterator[Any], source: Optional[iterators.LoopSource],
                 desc: Optional[dict], fetched: int, pending: Optional[str] = None, current: Any = None,
                 digests: Optional[dict] = None, extra: Optional[dict] = None) -> None:
        self.rt = rt
        self.ctl = rt.ctl
        self.node = node
        self.it = it
        self.source = source
        self.desc = desc
        self.fetched = fetched
        self.current = current
        self.pending = pending
        #: the digests of the items taken from leaves a restore replays (`iterators.with_item_digests`)
        self.digests = digests if digests is not None else (source.digests if source is not None else {})
        #: leaf index -> items the body took from that leaf's iterator with next() (manual_next.py)
        self.extra: dict[int, int] = extra if extra is not None else {}

    def __iter__(self) -> "ForFrame":
        return self

    def __next__(self) -> Any:
        if self.pending is not None:
            return self._resume()
        rt = self.rt
        rt.step += 1
        if self.ctl.flag:
            rt.safe_point(None)
        item = next(self.it)
        self.fetched += 1
        self.current = item
        return item

    def _resume(self) -> Any:
        """First ``next()`` after a restore: no safe point, it was taken before the checkpoint."""
        pending, self.pending = self.pending, None
        if pending == "inside":  # resuming inside the body: hand the same item back
            return self.current
        item = next(self.it)
        self.fetched += 1
        self.current = item
        return item

    @property
    def count(self) -> int:
        return self.fetched


class WhileFrame:
    """A running ``while`` loop; ``tick()`` runs before each test of its condition."""

    __slots__ = ("rt", "ctl", "node", "ticks", "pending")
    kind = "while"

    def __init__(self, rt: LoopHost, node: int, ticks: int = 0, pending: Optional[str] = None) -> None:
        self.rt = rt
        self.ctl = rt.ctl
        self.node = node
        self.ticks = ticks
        self.pending = pending

    def tick(self) -> bool:
        """Return True only to re-enter the body without re-testing the condition (restore)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if pending == "inside":
                return True
            self.ticks += 1
            return False
        rt = self.rt
        rt.step += 1
        if self.ctl.flag:
            rt.safe_point(None)
        self.ticks += 1
        return False

    @property
    def count(self) -> int:
        return self.ticks


class IfFrame:
    __slots__ = ("node", "branch")
    kind = "if"

    def __init__(self, node: int, branch: bool) -> None:
        self.node = node
        self.branch = branch


class BlockFrame:
    """Frame of a ``with`` or ``try`` body; a context manager so Python pops it on any exit."""

    __slots__ = ("rt", "node", "kind", "managers", "saved_files", "modes_before", "settings_before", "saved_held",
                 "rng_before")

    def __init__(self, rt: LoopHost, node: int, kind: str, saved_files: Optional[list] = None,
                 modes_before: tuple = (None, None), saved_held: Optional[list] = None,
                 rng_before: Optional[dict] = None) -> None:
        self.rt = rt
        self.node = node
        self.kind = kind
        self.managers: list = []  # a with statement's context managers, in item order
        self.saved_files = saved_files or []  # on restore: the checkpoint's handles of the files it wrote
        self.saved_held = saved_held or []  # on restore: the job's own managers it held (held_managers.py)
        self.modes_before = modes_before  # grad mode and decimal context before a with statement (scoped_modes.py)
        #: process settings before the first context manager that switches some (scoped_modes.py)
        self.settings_before: Optional[dict] = None
        #: item index -> the global generators before a manager that puts them back at its end (rng.forks)
        self.rng_before = rng_before

    def __enter__(self) -> "BlockFrame":
        self.rt.stack.append(self)
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        stack = self.rt.stack
        if stack and stack[-1] is self:
            stack.pop()
        if et is None and self.rt.preempted_exc is not None:
            raise self.rt.preempted_exc  # a context manager inside swallowed the preemption
        return False
