"""Library sentinels stay the library's own objects across a restore.

``dataclasses.MISSING`` (and ``KW_ONLY``) is an instance without state that ``dataclasses``
compares by identity: ``f.default is MISSING``. A dataclass the program defines is saved by
value, its fields with it, and plain pickling made a new ``_MISSING_TYPE`` instance, so after a
restore ``dataclasses.fields(Config)[0].default is MISSING`` was false: a "print the overridden
options" helper listed every field, silently. An instance of a library class that carries no
state and that its class's module names (``MISSING = _MISSING_TYPE()``) is saved here as that
name, and loads as the restoring process's object. Instances with state are left alone: one a
program changed would otherwise come back as the fresh import's.
"""
from __future__ import annotations

import copyreg
import sys
from typing import Any, Optional

from . import type_memos

#: per class: id of each stateless instance its module names -> (module, name)
_NAMED: dict[type, dict[int, tuple[str, str]]] = type_memos.new_dict()
#: modules whose classes are the program's own: saved by value, as they are
_PROGRAM_MODULES = ("__main__", "__mp_main__", "builtins")


def named_instances(t: type) -> dict[int, tuple[str, str]]:
    """The stateless instances of ``t`` that ``t``'s module holds under a name (read once per class)."""
    found = _NAMED.get(t)
    if found is None:
        found = _NAMED[t] = {}
        module = sys.modules.get(getattr(t, "__module__", None) or "")
        if module is not None and module.__name__ not in _PROGRAM_MODULES and _default_pickling(t):
            for name, value in list(vars(module).items()):
                if type(value) is t and not name.startswith("__") and not getattr(value, "__dict__", None):
                    found[id(value)] = (module.__name__, name)
    return found


def _default_pickling(t: type) -> bool:
    return t.__reduce_ex__ is object.__reduce_ex__ and t.__reduce__ is object.__reduce__ \
        and not getattr(t, "__slots__", ()) and copyreg.dispatch_table.get(t) is None


def reduce(obj: Any, t: type) -> Optional[tuple]:
    """``(getattr, (module, name))`` for a library sentinel, else None."""
    named = named_instances(t)
    where = named.get(id(obj)) if named else None
    if where is None or getattr(obj, "__dict__", None):
        return None
    return _named, where


def _named(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(module), name)
