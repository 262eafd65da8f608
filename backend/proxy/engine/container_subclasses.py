"""Subclasses of ``OrderedDict``, ``defaultdict``, ``Counter`` and ``deque``, pickled so they load.

Those four pickle by calling their class again with the base class's arguments
(``LRU()``, ``Vocab(list)``, ``Window(items, maxlen)``); a subclass whose ``__init__`` takes
others (``class LRU(OrderedDict): def __init__(self, cap)``) made a checkpoint that could not be
loaded, and ``defaultdict``'s drops the subclass's attributes altogether. Here an instance is
made without ``__init__``, as for any other object, and gets its items, its attributes and
(``defaultdict``) its factory, or (``deque``) its maximum length. A subclass with its own
``__reduce__`` keeps it.
"""
from __future__ import annotations

import collections
import copyreg
from typing import Any

_BASES = (collections.OrderedDict, collections.Counter, collections.defaultdict, collections.deque)


def reduce(obj: Any, t: type) -> Any:
    """A reduction for an instance of a subclass of one of `_BASES`, else NotImplemented."""
    if t in _BASES or not isinstance(obj, _BASES):
        return NotImplemented
    base = next(b for b in t.__mro__ if b in _BASES)
    if t.__reduce__ is not base.__reduce__ or t.__reduce_ex__ is not base.__reduce_ex__:
        return NotImplemented
    attributes = dict(getattr(obj, "__dict__", {}))
    if base is collections.deque:
        return _deque, (t, list(obj), obj.maxlen), attributes or None
    if base is collections.defaultdict:
        return (copyreg.__newobj__, (t,), (obj.default_factory, attributes), None, iter(obj.items()),
                _set_defaultdict)
    return copyreg.__newobj__, (t,), attributes or None, None, iter(obj.items())


def _deque(cls: type, items: list, maxlen: Any) -> Any:
    d = cls.__new__(cls)
    collections.deque.__init__(d, items, maxlen)
    return d


def _set_defaultdict(d: Any, state: tuple) -> None:
    d.default_factory, attributes = state
    d.__dict__.update(attributes)
