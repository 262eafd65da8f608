"""Items a program takes from an iterator by hand, with ``next()``, that a restore must take again.

A restore re-creates some loop iterators (a file re-opened by the ``with`` statement around the
loop, a generator made by the loop's own expression) and skips the items the loop had taken.
Two shapes take items the loop never sees: a header read before the loop
(``with open(p) as f: header = next(f)`` then ``for line in f:``), and records of several lines
read in the body (``for src in f: tgt = next(f)``). Skipping only the loop's items then resumed
one line off: the restore refused, or the pairs came out misaligned, silently.

So the program's ``next(...)`` calls, and those of the helper modules of the job's folder, go
through `Runtime.next_item` (the rewrite renames them),
which counts, per text file, the lines taken so (`took`), and, per loop whose replayed leaf the
item came from, the extra items (the loop frame's ``extra``, folded into its items' digest too).
A loop records where its file started (`start_of`: the position when ``tell()`` still works,
else the lines taken by ``next()``), and a restore puts the re-opened file there (`apply_start`)
before skipping the loop's items plus its extra ones.

A text file the program holds in a variable (``f = open(p)``; ``header = next(f)``; ``for line
in f:``) is pickled with its place, but ``next()`` and a ``for`` loop disable its ``tell()``. So
every text file's lines are counted from an *anchor*, the last ``tell()`` known before them
(`anchor`, at each counted ``next()`` and at each loop's start): the loops of the program read
it through `CountedLines`, and its ``next()`` calls are counted by `took`. `place` gives (anchor,
lines since) for a file whose ``tell()`` is disabled; the restore seeks the anchor and reads that
many lines (open_files.py).
"""
from __future__ import annotations

import io
import warnings
import weakref
from typing import Any, Iterator, Optional

from . import item_digest

#: text file -> lines the program took from it with next() since its anchor
_lines: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
#: text file -> the tell() cookie its counted lines start from
_anchors: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
#: text file -> the loop readers (`CountedLines`) made since its anchor
_loops: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def anchor(f: Any) -> None:
    """Before lines of text file ``f`` are counted: where ``tell()`` still works (no ``next()``
    or loop has read it since it was opened, sought or anchored), counting starts again there."""
    try:
        cookie = f.tell()
    except (OSError, ValueError):  # lines are being counted from an earlier anchor, or f is closed
        return
    _anchors[f] = cookie
    _lines[f] = 0
    _loops[f] = []


class CountedLines:
    """A loop's reader of a text file: the lines pass through, counted (`place`)."""

    __slots__ = ("f", "n", "__weakref__")

    def __init__(self, f: Any) -> None:
        anchor(f)
        self.f = f
        self.n = 0
        _loops.setdefault(f, []).append(self)

    def __iter__(self) -> "CountedLines":
        return self

    def __next__(self) -> Any:
        line = next(self.f)
        self.n += 1
        return line


def counted(value: Any) -> Any:
    """The iterator a loop over ``value`` reads: a readable text file's lines are counted."""
    if isinstance(value, io.TextIOWrapper) and not value.closed and value.readable():
        return CountedLines(value)
    return iter(value)


def place(f: Any) -> Optional[tuple[int, int]]:
    """(anchor cookie, lines read since) of text file ``f``, or None where its lines were not
    counted (read by something other than the program's loops and ``next()`` calls)."""
    cookie = _anchors.get(f)
    if cookie is None:
        return None
    return cookie, _lines.get(f, 0) + sum(reader.n for reader in _loops.get(f, ()))


def _reads(digesting: Any, it: Any) -> bool:
    inner = digesting.it
    return inner is it or (type(inner) is CountedLines and inner.f is it)


def took(stack: list, it: Any, item: Any) -> None:
    """The program took ``item`` from ``it`` with ``next()``; ``stack``: its loop frames."""
    if isinstance(it, io.TextIOBase):
        _lines[it] = _lines.get(it, 0) + 1
    for frame in reversed(stack):
        digests = getattr(frame, "digests", None)
        if not digests:
            continue
        for index, digesting in digests.items():
            if _reads(digesting, it):
                frame.extra[index] = frame.extra.get(index, 0) + 1
                digesting.value = item_digest.fold(digesting.value, item)
                return


def start_of(value: Any) -> Optional[tuple]:
    """Where a text file a loop starts on stands: ``("seek", cookie)``, or ``("seek", cookie, n)``
    after lines read by ``next()`` or a loop since a known ``tell()`` (which they disable; an
    earlier engine wrote ``("lines", n)``, from the file's start); None for anything else or a
    file at its start."""
    if not isinstance(value, io.TextIOBase) or not value.readable():
        return None
    try:
        position = value.tell()
    except (OSError, ValueError):
        known = place(value)
        return ("seek", *known) if known is not None else ("lines", _lines.get(value, 0))
    return ("seek", position) if position else None


#: files a restore's with statements opened again for reading, until a loop over them takes its place back
_reopened: dict[int, tuple[Any, int]] = {}


def reopened(f: Any, line: int) -> None:
    """The restore entered the with statement at ``line`` again, which opened ``f`` again."""
    _reopened[id(f)] = (f, line)


def warn_reopened() -> None:
    """Once the restore reached its position: warn of the re-opened files no loop took back to
    their place (read with ``read()``/``readline()``: those reads start where the header left them)."""
    for f, line in _reopened.values():
        warnings.warn(f"restore re-entered the with statement at line {line}, which re-opened "
                      f"{getattr(f, 'name', f)!r}: reads through it that no loop makes start where the "
                      f"header leaves them, not where they were at the checkpoint", RuntimeWarning, stacklevel=2)
    _reopened.clear()


def apply_start(it: Iterator[Any], start: Optional[tuple[str, Any]]) -> None:
    """Put a re-opened file where `start_of` found the original (a loop over it is then advanced
    back to its item)."""
    _reopened.pop(id(it), None)
    if start is None:
        return
    how, where, *lines = start
    if how == "seek":
        it.seek(where)  # type: ignore[attr-defined]
        skip_lines(it, lines[0] if lines else 0)
        return
    skip_lines(it, where)


def skip_lines(f: Any, n: int) -> None:
    """Read ``n`` lines of ``f`` with ``readline()``, which (unlike ``next()``) leaves ``tell()`` working."""
    for _ in range(n):
        if not f.readline():
            break
