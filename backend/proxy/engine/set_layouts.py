"""The iteration order of sets, kept across a restore.

A set unpickles by adding its elements, in the order they iterated, to a fresh table. CPython
places each element by its hash, the table's size and what was added and removed before, so a
rebuilt set can iterate in another order (about half the sets of a few strings that saw a
deletion), ``pop()`` another element and grow at another moment. A program that prints a set,
or numbers its vocabulary by looping over one, would differ from an uninterrupted run: silently.

So the checkpoint records the table of every set a rebuild would lay out differently: its size,
the slot of each element and of each deleted-entry marker, the fill and ``pop()``'s finger. The
graph pickles a `Pending` last; it becomes the list of (set, layout) pairs, the sets being memo
references to the objects pickled above, and unpickling it writes each table back.

The tables are read and written through ctypes, as CPython lays out a set object
(``Include/cpython/setobject.h``, unchanged from 3.8 to 3.13). A self-test on first use checks
that layout on this interpreter; where it fails, or where an element hashes differently in the
restoring process (objects hashed by address, whose order never repeats from run to run), the
set stays as rebuilt.
"""
from __future__ import annotations

import ctypes
import gc
import sys
import sysconfig
from array import array
from itertools import compress
from operator import itemgetter
from typing import Any, Optional

_SMALL = 8  # PySet_MINSIZE


class _Entry(ctypes.Structure):
    _fields_ = [("key", ctypes.c_void_p), ("hash", ctypes.c_ssize_t)]


class _SetObject(ctypes.Structure):
    _fields_ = [("ob_refcnt", ctypes.c_ssize_t), ("ob_type", ctypes.c_void_p),
                ("fill", ctypes.c_ssize_t), ("used", ctypes.c_ssize_t), ("mask", ctypes.c_ssize_t),
                ("table", ctypes.c_void_p), ("hash", ctypes.c_ssize_t), ("finger", ctypes.c_ssize_t),
                ("smalltable", _Entry * _SMALL)]


_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes, _decref.restype = [ctypes.py_object], None


#: (mask, fill, finger, element slots, marker slots, hashes, elements in iteration order);
#: the slots and hashes as the bytes of int64 arrays
Layout = tuple


class Pending:
    """Placed last in a checkpoint's graph; pickles as the layouts of the sets pickled before it."""


def _struct(s: Any) -> _SetObject:
    return _SetObject.from_address(id(s))


def _table_bytes(so: _SetObject) -> bytes:
    """The table's entries: (key address, hash) pairs of 64-bit words."""
    return ctypes.string_at(so.table, (so.mask + 1) * ctypes.sizeof(_Entry))


_DUMMY: dict[str, Optional[int]] = {}  # "address": the deleted-entry marker, or None: layout unusable


def _dummy_address() -> Optional[int]:
    """The address of CPython's deleted-entry marker, after checking the layout on a probe set."""
    if "address" in _DUMMY:
        return _DUMMY["address"]
    address: Optional[int] = None
    try:
        probe = {f"k{i}" for i in range(40)}
        for i in range(0, 40, 3):
            probe.discard(f"k{i}")
        so = _struct(probe)
        # the fields read without following a pointer first: another layout (a debug or
        # free-threaded build) must fail here, not dereference a misread table pointer
        if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED") \
                or set.__basicsize__ != ctypes.sizeof(_SetObject) + ctypes.sizeof(ctypes.c_void_p) \
                or list.__basicsize__ != ctypes.sizeof(_ListHead) + 2 * ctypes.sizeof(ctypes.c_void_p) \
                or so.used != len(probe) or sys.getsizeof(probe) - sys.getsizeof(set()) != \
                (so.mask + 1) * ctypes.sizeof(_Entry) or so.mask & (so.mask + 1):
            raise LookupError("not the set layout this module knows")
        words = array("q", _table_bytes(so))
        markers = {words[i] for i in range(0, len(words), 2) if words[i + 1] == -1}
        live = [words[i] for i in range(0, len(words), 2) if words[i] and words[i + 1] != -1]
        if so.used == len(probe) and live == [id(x) for x in probe] and len(markers) == 1 \
                and sys.getsizeof(probe) - sys.getsizeof(set()) == (so.mask + 1) * ctypes.sizeof(_Entry) \
                and so.fill == so.used + sum(1 for i in range(1, len(words), 2) if words[i] == -1):
            address = markers.pop()
    except Exception:  # another interpreter's layout: sets stay as rebuilt
        address = None
    _DUMMY["address"] = address
    if address is not None and not _round_trip_works():
        _DUMMY["address"] = address = None
    return address


def _round_trip_works() -> bool:
    """Whether a recorded table written back onto a rebuilt set gives the same table, with every
    element's reference count as it was once the rebuilt set's old table is released."""
    words = [f"w{i}" for i in range(300)]
    original = set(words)
    for w in words[::2]:
        original.discard(w)
    original.pop()
    layout = record(original)
    counts = [sys.getrefcount(w) for w in words]
    copy = set(original)
    if layout is None or not apply(copy, layout) or _state(copy) != _state(original):
        return False
    del copy
    return [sys.getrefcount(w) for w in words] == counts


def _state(s: Any) -> tuple:
    so = _struct(s)
    return so.mask, so.fill, so.used, so.finger, _table_bytes(so)


def _rebuilt_like_unpickling(s: Any) -> set:
    rebuilt: set = set()
    rebuilt.update(list(s))  # pickle's ADDITEMS: the elements added one by one, in iteration order
    return rebuilt


def record(s: Any) -> Optional[Layout]:
    """``s``'s table, or None where unpickling rebuilds the same table (or the layout is unknown)."""
    dummy = _dummy_address()
    if dummy is None:
        return None
    so = _struct(s)
    # a deleted-entry marker (fill > used) or a moved finger: a rebuild has neither, no need to try
    if type(s) in (set, frozenset) and so.finger == 0 and so.fill == so.used \
            and _state(_rebuilt_like_unpickling(s)) == _state(s):
        return None
    import numpy as np  # a million-element vocabulary: 0.1 s, where a Python loop took 0.9 s

    words = np.frombuffer(_table_bytes(so), dtype=np.int64)
    keys, hashes = words[0::2], words[1::2]
    markers = np.flatnonzero(keys == dummy)
    slots = np.flatnonzero((keys != 0) & (keys != dummy))
    elements = tuple(s)
    if len(slots) != len(elements) or not np.array_equal(keys[slots], _addresses(elements)):
        return None
    return (so.mask, so.fill, so.finger, slots.astype(np.int64).tobytes(), markers.astype(np.int64).tobytes(),
            hashes[slots].tobytes(), elements)


def _addresses(objects: Any) -> Any:
    import numpy as np

    return np.fromiter(map(id, objects), dtype=np.int64, count=len(objects))


def apply(s: Any, layout: Layout) -> bool:
    """Give ``s`` (holding the layout's elements) the recorded table; False where it cannot."""
    import numpy as np

    dummy = _dummy_address()
    mask, fill, finger, slot_bytes, marker_bytes, hash_bytes, elements = layout
    if dummy is None or len(elements) != len(s):
        return False
    members = list(elements)
    if not np.array_equal(np.sort(_addresses(members)), np.sort(_addresses(s))):
        try:  # the set's own objects (ints and floats are not memoised: the layout has copies)
            members = list(map(dict(zip(s, s)).__getitem__, elements))
        except (KeyError, TypeError):
            return False
    hashes = np.frombuffer(hash_bytes, dtype=np.int64)
    if not np.array_equal(np.fromiter(map(hash, members), dtype=np.int64, count=len(members)), hashes):
        return False  # hashed by address (or differently) in this process: no order to keep
    slots, markers = np.frombuffer(slot_bytes, dtype=np.int64), np.frombuffer(marker_bytes, dtype=np.int64)
    table = np.zeros(2 * (mask + 1), dtype=np.int64)
    table[2 * slots], table[2 * slots + 1] = _addresses(members), hashes
    table[2 * markers], table[2 * markers + 1] = dummy, -1
    fresh = _table_of_size(mask + 1, members)
    if fresh is None:
        return False
    fresh_set, held, placeholders = fresh
    collecting = gc.isenabled()
    gc.disable()  # no collection may walk a table half written
    try:
        target = _struct(fresh_set)
        ctypes.memmove(target.table, table.ctypes.data, table.nbytes)
        # the new table refers to every member once: the first ``held`` had their reference from
        # sizing the table; the others get the references a new list takes, handed over
        _hand_over_references(members[held:])
        for placeholder in placeholders:  # the table's references to them were overwritten
            _decref(placeholder)
        target.fill, target.used, target.finger = fill, len(members), finger
        _swap_tables(_struct(s), target)
    finally:
        if collecting:
            gc.enable()
    return True  # fresh_set now holds s's former table, released with it


def _hand_over_references(objects: list) -> None:
    """Leave one more reference to each of ``objects`` with nobody holding it (for a table
    written by hand): the list takes one each, and is emptied without giving them back."""
    if objects:
        _ListHead.from_address(id(objects)).ob_size = 0


class _ListHead(ctypes.Structure):
    _fields_ = [("ob_refcnt", ctypes.c_ssize_t), ("ob_type", ctypes.c_void_p), ("ob_size", ctypes.c_ssize_t)]


def _table_of_size(size: int, members: list) -> Optional[tuple[set, int, list]]:
    """A set whose table has ``size`` slots, how many of ``members`` (the first ones) it holds,
    and the placeholders it holds besides.

    A set grows its table only as it fills; ``update`` from another set sizes it at once for
    twice the elements to come (smallest power of two above), which reaches every size. The
    elements it is sized with are the members themselves where there are enough."""
    if size == _SMALL:
        return set(), 0, []
    wanted = max(size // 4, 5)
    held = min(wanted, len(members))
    placeholders = [object() for _ in range(wanted - held)]
    fresh: set = set()
    fresh.update({*members[:held], *placeholders})
    if _struct(fresh).mask + 1 != size:
        return None
    return fresh, held, placeholders


def _swap_tables(a: _SetObject, b: _SetObject) -> None:
    """Exchange two sets' tables (a small table lives inside its set: copied, not pointed at)."""
    def taken(so: _SetObject) -> tuple:
        small = so.table == ctypes.addressof(so.smalltable)
        return so.fill, so.used, so.mask, so.finger, small, so.table, bytes(so.smalltable)

    def give(so: _SetObject, state: tuple) -> None:
        so.fill, so.used, so.mask, so.finger, small, table, smalltable = state
        ctypes.memmove(ctypes.addressof(so.smalltable), smalltable, len(smalltable))
        so.table = ctypes.addressof(so.smalltable) if small else table

    first, second = taken(a), taken(b)
    give(a, second)
    give(b, first)


def reduce_pending(memo: Any) -> tuple:
    """`Pending`'s reduction: the (set, layout) pairs of the sets in the pickler's memo.

    Every memoised object is looked at, so the scan keeps to C-level map/compress (a graph of
    25,000 memoised objects costs ~3 ms)."""
    objects = list(map(itemgetter(1), memo.copy().values()))
    kinds = frozenset(t for t in set(map(type, objects)) if issubclass(t, (set, frozenset)))
    pairs = []
    for s in compress(objects, map(kinds.__contains__, map(type, objects))) if kinds else ():
        layout = record(s) if s else None
        if layout is not None:
            pairs.append((s, layout))
    return restore, (pairs,)


def restore(pairs: list) -> int:
    """Write the recorded tables back; the count of sets that now have theirs."""
    return sum(1 for s, layout in pairs if apply(s, layout))
