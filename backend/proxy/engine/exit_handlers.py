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
import warnings
from typing import Any, Callable, Optional

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


def uninstall(ended: bool) -> None:
    """The program returned, raised (``ended``: its handlers now run at the interpreter's exit,
    as they would have) or stopped for a preemption (they stay in the checkpoint only)."""
    atexit.register, atexit.unregister = _REGISTER, _UNREGISTER  # type: ignore[assignment]
    handlers, _handlers[:] = list(_handlers), []
    if ended:
        for func, args, kwargs in handlers:
            _REGISTER(func, *args, **kwargs)
