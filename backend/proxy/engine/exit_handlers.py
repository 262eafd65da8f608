"""``atexit`` handlers the program registers, kept with its checkpoints and run once, at its real end.

``atexit.register(write_summary, "summary.json")`` at the top of a script runs once, before the
loop. Left to the interpreter, the handler ran in every process that stopped for a preemption
(writing a summary of a run half done, or failing on state torn down for the stop), and a
restore, which does not run the statements before the safe point again, left the new process
without it: the run's real end wrote nothing, or left the early summary in place, a silent
difference. So while a program runs, ``atexit.register`` keeps the program's own handlers
(`ownership.PROGRAM`: its functions, methods of its objects, partials of them) in a list the
checkpoint saves, and hands them to the interpreter only when the program ends for good (returns
or raises); a process that stops for a preemption does not run them. Handlers of libraries go
to the interpreter at once, as before.
"""
from __future__ import annotations

import atexit
import builtins
import gc
import sys
import warnings
from typing import Any, Callable, Optional

from . import finalizers, library_patches
from .ownership import PROGRAM

_REGISTER = atexit.register
_UNREGISTER = atexit.unregister
#: (function, args, kwargs) of the program's handlers, in the order it registered them
_handlers: list[tuple[Callable[..., Any], tuple, dict]] = []


def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """`atexit.register`; the program's own handlers are kept for its real end."""
    if not PROGRAM(func):
        return _REGISTER(func, *args, **kwargs)
    _handlers.append((func, args, kwargs))
    return func


def unregister(func: Callable[..., Any]) -> None:
    """`atexit.unregister`: removes ``func`` (compared with ``==``, as atexit does) from both lists."""
    _handlers[:] = [h for h in _handlers if h[0] != func]
    _UNREGISTER(func)


def install(saved: Optional[list] = None) -> None:
    """Keep the program's handlers from now until `uninstall`; ``saved``: a checkpoint's."""
    _handlers[:] = saved or []
    atexit.register, atexit.unregister = register, unregister  # type: ignore[assignment]


def capture(probe: Callable[[Any], Optional[str]]) -> list:
    """The handlers to save; one that cannot be saved is left out with a warning naming it (the
    stopping process does not run it either)."""
    kept = []
    for handler in _handlers:
        why = probe(handler)
        if why is not None:
            warnings.warn(f"the atexit handler {handler[0]!r} cannot be saved ({why}); a restored run "
                          f"will not run it at its end", RuntimeWarning, stacklevel=3)
            continue
        kept.append(handler)
    return kept


def uninstall(ended: bool, main_globals: Optional[dict] = None) -> None:
    """The program returned, raised (``ended``: its handlers now run at the interpreter's exit,
    as they would have) or stopped for a preemption (they stay in the checkpoint only).

    ``main_globals``: a script's ``__main__`` namespace, cleared after the handlers as the
    interpreter clears ``__main__`` at exit, so the ``__del__`` of its objects (a summary
    printed, a buffer flushed) runs as in a plain run, at the real end only, and while the
    job's output is still captured: the worker's own exit skipped it, or ran it once the
    interpreter had put the original ``sys.stdout`` back, whose lines nobody read."""
    atexit.register, atexit.unregister = _REGISTER, _UNREGISTER  # type: ignore[assignment]
    handlers, _handlers[:] = list(_handlers), []
    if ended:
        if main_globals is not None:
            _REGISTER(_clear_like_the_interpreter, main_globals)  # atexit runs last what it got first
        for func, args, kwargs in handlers:
            _REGISTER(func, *args, **kwargs)


def _clear_like_the_interpreter(namespace: dict) -> None:
    """What CPython does at exit: the builtins as they were at start put back (a replaced
    ``print`` is not the one ``__del__`` methods find), then ``__main__``'s dict cleared (a
    script's functions and classes hold it in a cycle, so the collector clears it: its values
    go in the order they were set); then a collection for the rest."""
    finalizers.run_at_exit()  # weakref.finalize(..., atexit=True): its own handler runs before modules go
    vars(builtins).update(library_patches.PRISTINE_BUILTINS)
    namespace.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
