"""Instances of classes with a ``__getattr__``, pickled so that they load.

A wrapper that hands unknown attributes to what it wraps (``def __getattr__(self, name): return
getattr(self.model, name)``, an EMA or a DDP-like wrapper; ``tempfile.NamedTemporaryFile``'s
``self.__dict__['file']``) pickles, but does not load: the unpickler asks the new, empty
instance for ``__setstate__``, which is not there, so ``__getattr__`` runs before any attribute
is set and recurses forever or raises ``KeyError``. The checkpoint was written, and the restore
crashed. Here such an instance is saved as plain pickling would save it, with a state setter
that fills its ``__dict__`` (and slots) directly, as the unpickler's own default does, without
asking the instance anything.
"""
from __future__ import annotations

from typing import Any

from . import type_memos

#: per class: whether its instances need `reduce` (a ``__getattr__``, pickled the default way)
_NEEDS: dict[type, bool] = type_memos.new_dict()


def _needs(t: type) -> bool:
    found = _NEEDS.get(t)
    if found is None:
        found = _NEEDS[t] = (
            getattr(t, "__getattr__", None) is not None
            and getattr(t, "__setstate__", None) is None
            and t.__reduce_ex__ is object.__reduce_ex__ and t.__reduce__ is object.__reduce__)
    return found


def reduce(obj: Any, t: type, protocol: int) -> Any:
    """The default reduction of ``obj`` with `_fill` as its state setter, or NotImplemented."""
    if isinstance(obj, type) or not _needs(t):
        return NotImplemented
    reduced = obj.__reduce_ex__(protocol)
    if not isinstance(reduced, tuple) or len(reduced) < 3 or reduced[2] is None:
        return NotImplemented
    rest = tuple(reduced[3:5]) + (None,) * (5 - len(reduced))
    return (*reduced[:2], reduced[2], *rest, _fill)


def _fill(obj: Any, state: Any) -> None:
    """What the unpickler does with a state when the object has no ``__setstate__``."""
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        obj.__dict__.update(state)
    for name, value in (slots or {}).items():
        object.__setattr__(obj, name, value)
