"""``weakref.finalize`` callbacks, kept across a restore.

``weakref.finalize(obj, release, path)`` keeps its callback in a registry of the ``weakref``
module, not in the object: a checkpoint of the program's variables left it behind, so after a
restore the callback never ran, neither when ``obj`` went away nor at exit (a lock file never
removed, a "released" line never printed), and a finalizer the program kept
(``self._finalizer = weakref.finalize(self, ...)``) came back dead. Here:

* a live finalizer pickled with the program's state (an attribute) is made again over the
  restored object, with its callback, arguments and ``atexit`` flag;
* the checkpoint's graph ends with a `Pending` that becomes the live finalizers whose callback
  is the program's (`ownership.PROGRAM`) and whose object the graph saved, in the order they
  were made; a finalizer over an object the checkpoint does not hold is left out (made again over
  a copy nothing refers to, it would fire at once).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from .ownership import PROGRAM


class Pending:
    """Placed near the end of a checkpoint's graph; pickles as the program's live finalizers."""


def _registry() -> dict:
    return weakref.finalize._registry  # type: ignore[attr-defined]


def reduce_finalizer(fin: weakref.finalize) -> tuple:
    """A finalizer made again on load: live, over the restored object; dead, as a dead one."""
    info = _registry().get(fin)
    obj = info.weakref() if info is not None else None
    if obj is None:
        return _dead, ()
    return _new, (obj, info.func, info.args, info.kwargs or {}, info.atexit)


def reduce_pending(memo: Any) -> tuple:
    """`Pending`'s reduction: the program's live finalizers over objects in the pickler's memo,
    that the graph did not already save (as an attribute)."""
    mine = sorted(((f, info) for f, info in list(_registry().items()) if PROGRAM(info.func)),
                  key=lambda pair: pair[1].index)
    if not mine:
        return tuple, ()
    saved = memo.copy()
    kept = []
    for fin, info in mine:
        obj = info.weakref()
        if obj is not None and id(obj) in saved and id(fin) not in saved:
            kept.append(fin)
    return tuple, (kept,)


def _new(obj: Any, func: Callable[..., Any], args: tuple, kwargs: dict, at_exit: bool) -> weakref.finalize:
    fin = weakref.finalize(obj, func, *args, **kwargs)
    fin.atexit = at_exit
    return fin


def _dead() -> weakref.finalize:
    return weakref.finalize.__new__(weakref.finalize)


def run_at_exit() -> None:
    """What ``weakref``'s own atexit handler does (call the live finalizers marked ``atexit``),
    for `exit_handlers` to run before it clears ``__main__``, as the interpreter does."""
    if getattr(weakref.finalize, "_registered_with_atexit", False):
        weakref.finalize._exitfunc()  # type: ignore[attr-defined]
