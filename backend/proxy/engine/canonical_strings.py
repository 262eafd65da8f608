"""Restored strings are the very objects the program's code holds, so what it pickles after a
restore has the uninterrupted run's bytes.

Why: pickle (and ``torch.save``) write a string once and then refer back to it by identity. A
history of dicts made before a stop comes back from the checkpoint; entries made after it use the
code's constants (``{"epoch": e, "val/acc": a}``). Were the restored keys other objects than those
constants, a program that pickles its history after a restore would write each key twice: the
file loads equal but its bytes differ from the uninterrupted run's.

How: a checkpoint file starts with a small *header* pickle listing the candidate strings, each a
persistent id that is memoised; the graph's pickler starts with these in its memo, so every
reference to a candidate in the graph is a memo get (two bytes). The same unpickler reads both
pickles: the header's ids resolve to the restoring process's own objects (the program's code,
compiled again, holds one object per value; an identifier-like string is the interned one, which
is what compiled code of any module uses), and the graph's memo gets land on them.

Candidates: every string constant and name of the program's code whose value only one object
has, the identifier-like constants of the functions of the job's own modules (a helper's
``dict(epoch=e)``), and the strings libraries compare by identity (`LIBRARY_SENTINELS`:
``argparse.SUPPRESS``, which argparse tests with ``is``: a restored parser's suppressed
``--help`` default was another object, and ``vars(parser.parse_args())`` gained a ``help`` key). Not covered: other text constants of helper modules (``"val/acc"`` in
``metrics.py``), and strings made at run time.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import struct
import sys
import types
from typing import Any, Iterable, Iterator, Optional

#: the first item of a header pickle: what tells it from a checkpoint graph
MARKER = "singularity-canonical-strings/1"
#: the most candidates a header lists (a job folder holding a large library stops here)
LIMIT = 50_000

#: (module, name) of strings a library compares with ``is``
LIBRARY_SENTINELS = (("argparse", "SUPPRESS"),)

_RESTORE_CODE: contextvars.ContextVar[Optional[types.CodeType]] = contextvars.ContextVar("sg_canon_code",
                                                                                         default=None)
_TABLES: dict[int, tuple[types.CodeType, dict[str, str]]] = {}
_MODULE_NAMES: dict[tuple[int, int], tuple[types.ModuleType, list[str]]] = {}


def identifier_like(s: str) -> bool:
    """What CPython interns among a code object's constants (letters, digits, underscore; ASCII)."""
    return s.isascii() and s.replace("_", "a").isalnum()


def _strings(code: types.CodeType) -> Iterator[str]:
    stack: list[Any] = [code]
    while stack:
        item = stack.pop()
        if isinstance(item, types.CodeType):
            yield from item.co_names
            yield from item.co_varnames
            yield from item.co_cellvars
            yield from item.co_freevars
            stack.extend(reversed(item.co_consts))
        elif type(item) is str:
            yield item
        elif isinstance(item, (tuple, frozenset)):
            stack.extend(item)


def program_table(code: Optional[types.CodeType]) -> dict[str, str]:
    """Value -> the one object of that value in ``code`` (values several objects have are left
    out: which of them a restored string should be cannot be told)."""
    if code is None:
        return {}
    cached = _TABLES.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    table: dict[str, str] = {}
    several: set[str] = set()
    for s in _strings(code):
        seen = table.get(s)
        if seen is not None and seen is not s:
            several.add(s)
        table.setdefault(s, s)
    for s in several:
        del table[s]
    _TABLES[id(code)] = (code, table)
    return table


def _module_identifiers(module: types.ModuleType) -> list[str]:
    key = (id(module), len(vars(module)))
    cached = _MODULE_NAMES.get(key)
    if cached is not None and cached[0] is module:
        return cached[1]
    codes = []
    for value in list(vars(module).values()):
        members = [value] + (list(vars(value).values()) if isinstance(value, type) else [])
        for member in members:
            fn = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(fn, property):
                fn = fn.fget
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType) and getattr(fn, "__module__", None) == module.__name__:
                codes.append(code)
    names = list(dict.fromkeys(s for code in codes for s in _strings(code) if identifier_like(s)))
    _MODULE_NAMES[key] = (module, names)
    return names


class Header:
    """The strings one checkpoint's header lists, its bytes per pickle protocol, and the memo the
    graph's pickler starts with. Made once per program and set of job modules (~1 ms for 2,000
    strings), not per checkpoint."""

    def __init__(self, strings: Iterable[str]) -> None:
        self.strings = tuple(strings)
        self._memo = {id(s): (i, s) for i, s in enumerate(self.strings)}
        self._bytes: dict[int, bytes] = {}

    def pickle(self, protocol: int) -> bytes:
        """A pickle of ``(MARKER, *strings)`` whose strings are persistent ids memoised in order
        (memo 0, 1, ...), for a graph pickle that follows it in the same stream."""
        data = self._bytes.get(protocol)
        if data is None:
            parts = [b"\x80" + bytes([protocol]), b"(", _unicode(MARKER)]
            for s in self.strings:
                parts += [_unicode(s), b"Q", b"\x94"]  # BINUNICODE, BINPERSID, MEMOIZE
            parts += [b"t", b"."]  # TUPLE, STOP
            data = self._bytes[protocol] = b"".join(parts)
        return data

    def preload(self, pickler: Any) -> None:
        """Start ``pickler``'s memo with the header's entries, so the graph refers to them."""
        if self.strings:
            pickler.memo = self._memo


EMPTY = Header(())
_HEADERS: dict[tuple, tuple[Optional[types.CodeType], list[types.ModuleType], Header]] = {}


def header_for(code: Optional[types.CodeType], modules: Iterable[types.ModuleType]) -> Header:
    """The header of a checkpoint of the program compiled as ``code`` that imported ``modules``
    from its folder: the program's strings, then the modules' identifier-like ones, at most `LIMIT`."""
    modules = list(modules)
    key = (id(code), tuple((id(m), len(vars(m))) for m in modules))
    cached = _HEADERS.get(key)
    if cached is not None and cached[0] is code and all(a is b for a, b in zip(cached[1], modules)):
        return cached[2]
    out = dict.fromkeys(_library_sentinels().values())
    out.update(dict.fromkeys(s for s in program_table(code).values() if s not in out))
    for module in modules:
        if len(out) >= LIMIT:
            break
        out.update(dict.fromkeys(_module_identifiers(module)))
    made = Header(list(out)[:LIMIT])
    if len(_HEADERS) > 64:
        _HEADERS.clear()
    _HEADERS[key] = (code, modules, made)
    return made


def _unicode(s: str) -> bytes:
    data = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def is_header(obj: Any) -> bool:
    return type(obj) is tuple and len(obj) > 0 and obj[0] == MARKER


@contextlib.contextmanager
def restoring(code: Optional[types.CodeType]) -> Iterator[None]:
    """While a checkpoint of the program compiled as ``code`` loads."""
    token = _RESTORE_CODE.set(code)
    try:
        yield
    finally:
        _RESTORE_CODE.reset(token)


@functools.lru_cache(maxsize=1)
def _library_sentinels() -> dict[str, str]:
    """Value -> the library's own object, for each of `LIBRARY_SENTINELS` (imported: stdlib)."""
    import importlib

    return {value: value for value in (getattr(importlib.import_module(m), n) for m, n in LIBRARY_SENTINELS)}


def resolve(value: str) -> str:
    """The restoring process's object for a header string."""
    found = _library_sentinels().get(value)
    if found is not None:
        return found
    found = program_table(_RESTORE_CODE.get()).get(value)
    if found is not None:
        return found
    return sys.intern(value) if identifier_like(value) else value
