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
in f:``) is pickled with its ``tell()``, which ``next()`` on a text file disables. So the program's
loops read text files through `LineReader` and its ``next(f)`` calls become ``f.readline()``:
the same lines, and ``tell()`` keeps working (~55 ns more a line). ``csv.reader`` reads through
the file's ``readline()`` too (`handles.CsvReader`). Only a library iterating the file itself still disables
it; such a file is then refused with advice, or re-read by the loop that a ``with`` statement
re-creates.
"""
from __future__ import annotations

import io
import warnings
import weakref
from typing import Any, Iterator, Optional

from . import item_digest

#: text file -> lines the program took from it with next() (where a library disabled its tell())
_lines: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


class LineReader:
    """A loop's reader of a text file: its lines through ``readline()``, which leaves the file's
    ``tell()`` working (iterating the file itself disables it)."""

    __slots__ = ("f", "readline")

    def __init__(self, f: Any) -> None:
        self.f = f
        self.readline = f.readline

    def __iter__(self) -> "LineReader":
        return self

    def __next__(self) -> Any:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def is_text_file(value: Any) -> bool:
    """An open, readable ``open()`` text file (whose ``next()`` would disable ``tell()``)."""
    return type(value) is io.TextIOWrapper and not value.closed and value.readable()


def reader_of(value: Any) -> Any:
    """The iterator a loop over ``value`` reads: a text file's lines through `LineReader`."""
    return LineReader(value) if is_text_file(value) else iter(value)


def next_line(f: Any, default: tuple) -> Any:
    """The program's ``next(f)`` on a text file: ``f.readline()``, StopIteration (or the default) at its end."""
    line = f.readline()
    if line:
        return line
    if default:
        return default[0]
    raise StopIteration


def _reads(digesting: Any, it: Any) -> bool:
    inner = digesting.it
    return inner is it or (type(inner) is LineReader and inner.f is it)


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


def start_of(value: Any) -> Optional[tuple[str, Any]]:
    """Where a text file a loop starts on stands: ``("seek", cookie)``, or ``("lines", n)`` where
    a library's ``next()`` disabled its ``tell()`` (the lines the program took with ``next()``);
    None for anything else or a file at its start."""
    if not isinstance(value, io.TextIOBase) or not value.readable():
        return None
    try:
        position = value.tell()
    except (OSError, ValueError):
        return ("lines", _lines.get(value, 0))
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
    back to its item). A file the loop began at its start goes back there: the restore of the
    ``with`` statement around the loop may have put it where the checkpoint found it."""
    _reopened.pop(id(it), None)
    if start is None:
        if is_text_file(it) and it.seekable():
            it.seek(0)
        return
    how, where = start
    if how == "seek":
        it.seek(where)  # type: ignore[attr-defined]
        return
    for _ in range(where):
        if not it.readline():  # type: ignore[attr-defined]
            break
