"""Load what a job sends back (results, outputs, a cell's variables) into the caller's process.

cloudpickle sends classes of the submitter's own modules and notebook cells by value. When a
result holding an instance of such a class comes back, cloudpickle maps it to the caller's class
(the same tracker id, so ``isinstance`` holds) and then sets every attribute of that class again
from the job's copy. That is right for what the job changed (``Meter.created += 1`` in a cell
must show in the notebook, as it would have run there), but it also replaces every method with
the job's copy, whose code says ``<dynamic-code>``: ``inspect.getsource`` fails on it, tracebacks
in the caller lose their lines, and the next ``client.submit(obj.method)`` runs without safe
points, since the worker gets no source to rewrite. ``loads`` applies the job's attributes but
keeps the caller's own function wherever the job's has the same code.

A function of ``__main__`` (a notebook cell's ``def``) travels with a copy of the globals it
reads, so where it arrives it would read that copy, not the namespace it runs in: a cell that
rebinds ``decay`` would not change what ``lr_at()`` reads, as it does in the notebook. With
``main_globals``, such functions are made with that namespace as their globals instead.
"""
from __future__ import annotations

import threading
import types
from typing import Any, Optional

__all__ = ["loads"]

_LOCK = threading.Lock()


def loads(data: bytes, main_globals: Optional[dict[str, Any]] = None) -> Any:
    """``cloudpickle.loads(data)``, keeping the methods of the caller's existing by-value classes;
    functions of ``__main__`` get ``main_globals`` (when given) as their globals."""
    import cloudpickle
    from cloudpickle import cloudpickle as impl

    tracker = getattr(impl, "_DYNAMIC_CLASS_TRACKER_BY_ID", None)
    setstate = getattr(impl, "_class_setstate", None)
    make_function = getattr(impl, "_make_function", None)
    if not hasattr(tracker, "values") or setstate is None or make_function is None:  # a cloudpickle built otherwise
        return cloudpickle.loads(data)
    with _LOCK:
        known = {id(cls) for cls in list(tracker.values())}

        def keep_own_methods(obj: Any, state: Any) -> Any:
            if id(obj) in known and isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
                attrs, slots = state
                attrs = {k: v for k, v in attrs.items() if not _same_code(obj.__dict__.get(k), v)}
                state = (attrs, slots)
            return setstate(obj, state)

        def make_in_main(code: Any, globals_: dict, name: Any, argdefs: Any, closure: Any) -> Any:
            if isinstance(main_globals, dict) and globals_.get("__name__") == "__main__":
                return types.FunctionType(code, main_globals, name, argdefs, closure)
            return make_function(code, globals_, name, argdefs, closure)

        # the stream names these helpers by module and name, looked up as it loads
        impl._class_setstate, impl._make_function = keep_own_methods, make_in_main
        try:
            return cloudpickle.loads(data)
        finally:
            impl._class_setstate, impl._make_function = setstate, make_function


def _same_code(mine: Any, theirs: Any) -> bool:
    """Whether a class attribute the job sent is the caller's own function, unchanged: the same
    kind (function, staticmethod, classmethod, property) around code that compares equal (code
    equality ignores the file name cloudpickle replaces)."""
    if mine is None or type(mine) is not type(theirs):
        return False
    if isinstance(mine, (staticmethod, classmethod)):
        return _same_code(mine.__func__, theirs.__func__)
    if isinstance(mine, property):
        return all(_same_code(a, b) if a is not None else b is None
                   for a, b in ((mine.fget, theirs.fget), (mine.fset, theirs.fset), (mine.fdel, theirs.fdel)))
    code = getattr(mine, "__code__", None)
    return code is not None and code == getattr(theirs, "__code__", None)
