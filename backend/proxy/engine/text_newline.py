"""The ``newline`` a text file was opened with, which Python keeps but does not show.

``open(path, "w", newline="")`` is how the csv module's documentation says to open a CSV file
(rows then end in ``"\\r\\n"``, the writer's own terminator, untranslated); ``newline="\\r\\n"``
writes Windows line ends. A restore that re-opened such a file with the default newline would
translate what the job writes next: the file would silently differ from an uninterrupted run's.
``io.TextIOWrapper`` exposes ``encoding``, ``errors`` and ``line_buffering``, but not
``newline``; it keeps it as the ``readnl`` field of its C struct (NULL for ``newline=None``, else
the string given). This module reads that field, after checking the struct's layout on wrappers
it makes itself: the fields on either side of ``readnl`` (``decoder`` and ``errors``) must be the
objects the wrapper's attributes return, and ``readnl`` must read back the newline each test
wrapper was given. Where the check fails (another interpreter), `newline_of` raises, so a
checkpoint refuses the file rather than re-open it with the wrong newline.
"""
from __future__ import annotations

import ctypes
import io
from functools import lru_cache
from typing import Optional

_POINTER = ctypes.sizeof(ctypes.c_void_p)
#: CPython 3.10–3.13 ``textio``: PyObject_HEAD, int ok, int detached, Py_ssize_t chunk_size, then
#: the pointers buffer, encoding, encoder, decoder, readnl, errors
_FIELDS = ("buffer", "encoding", "encoder", "decoder", "readnl", "errors")
_FIRST_FIELD = object.__basicsize__ + 2 * ctypes.sizeof(ctypes.c_int) + ctypes.sizeof(ctypes.c_ssize_t)


class NewlineUnknown(Exception):
    """This interpreter's text files do not keep ``newline`` where CPython's do."""


def _field(f: io.TextIOWrapper, name: str) -> int:
    return ctypes.c_void_p.from_address(id(f) + _FIRST_FIELD + _FIELDS.index(name) * _POINTER).value or 0


def _read(f: io.TextIOWrapper) -> Optional[str]:
    address = _field(f, "readnl")
    if not address:
        return None
    value = ctypes.cast(address, ctypes.py_object).value
    if not isinstance(value, str):
        raise NewlineUnknown(f"the text file's readnl field holds a {type(value).__name__}")
    return value


@lru_cache(maxsize=1)
def _layout_ok() -> bool:
    """Whether the struct is laid out as `_FIELDS` says, on wrappers made here."""
    if type(io.TextIOWrapper) is not type or io.TextIOWrapper.__module__ not in ("_io", "io"):
        return False
    for newline in (None, "", "\n", "\r", "\r\n"):
        f = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", newline=newline)
        try:
            if _field(f, "buffer") != id(f.buffer) or _field(f, "errors") != id(f.errors):
                return False
            if _read(f) != newline:
                return False
        except (NewlineUnknown, ValueError):
            return False
        finally:
            f.detach()
    return True


def newline_of(f: io.TextIOWrapper) -> Optional[str]:
    """The ``newline`` argument ``f`` was opened with (None: universal newlines, the default)."""
    if not isinstance(f, io.TextIOWrapper):
        raise NewlineUnknown(f"{type(f).__name__} is not an io.TextIOWrapper")
    if not _layout_ok():
        raise NewlineUnknown("this interpreter's io.TextIOWrapper is not laid out as CPython 3.10–3.13's")
    return _read(f)
