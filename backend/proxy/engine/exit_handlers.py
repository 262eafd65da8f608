"""``atexit`` handlers the program registers, kept with its checkpoints and run once, at its real end.

``atexit.register(write_summary, "summary.json")`` at the top of a script runs once, before the
loop. Left to the interpreter, the handler ran in every process that stopped for a preemption
(writing a summary of a run half done, or failing on state torn down for the stop), and a
restore, which does not run the statements before the safe point again, left the new process
without it: the run's real end wrote nothing, or left the early summary in place, a silent
difference. So while a program runs, ``atexit.register`` keeps the program's own handlers
(`ownership.PROGRAM`: its functions, methods of its objects, partials of them, and whatever its
own code registers) in a list the checkpoint saves, and gives the interpreter, in each one's
place, a stand-in that runs it only when the program ends for good (returns or raises); a
process that stops for a preemption does not run them. Handlers of libraries go to the
interpreter at once, as before.
"""
from __future__ import annotations

import atexit
import builtins
import dis
import functools
import gc
import io
import sys
import types
import warnings
import weakref
from typing import Any, Callable, Optional

from . import finalizers, library_patches
from .ownership import PROGRAM

_REGISTER = atexit.register
_UNREGISTER = atexit.unregister
Handler = tuple[Callable[..., Any], tuple, dict]
#: (function, args, kwargs) of the program's handlers, in the order it registered them
_handlers: list[Handler] = []
#: the handlers of the programs of this process that ended (a kernel runs one after another)
_ended: list[Handler] = []
#: the ``__main__`` namespace of a script that ended, for `_clear_at_the_real_end`
_ended_namespace: list[dict] = []


def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """`atexit.register`; the program's own handlers are kept for its real end: its functions,
    and whatever its own code registers (``atexit.register(print, "done")`` is the program's
    though ``print`` is not; it was lost by a restore)."""
    if not (PROGRAM(func) or _called_by_the_program()):
        return _REGISTER(func, *args, **kwargs)
    _keep((func, args, kwargs))
    return func


def _called_by_the_program() -> bool:
    """Whether the program's own code called ``atexit.register``: its frame is the caller and the
    statement it is at names ``register``. A C extension that registers a handler (pybind11's)
    has no frame, so the program's frame that called into it is found instead; the name tells
    the two apart."""
    caller = sys._getframe(2)  # the frame that called atexit.register, or the program's below C code
    return PROGRAM.owns(caller.f_code, caller.f_globals) and _names_register(caller.f_code, caller.f_lasti)


@functools.lru_cache(maxsize=256)
def _names_register(code: types.CodeType, lasti: int) -> bool:
    """Whether the call at instruction ``lasti`` of ``code`` calls a ``register``: a call
    expression starts where its callee does, so the callee loaded by the name ``register``
    (``atexit.register``, ``register`` imported) starts where the call does."""
    instructions = list(dis.get_instructions(code))
    call = next((i for i in reversed(instructions) if i.offset <= lasti), None)  # lasti may point into its caches
    if call is None or call.positions is None or call.positions.lineno is None:
        return False
    start = (call.positions.lineno, call.positions.col_offset)
    return any(i.opname.startswith("LOAD_") and i.argval == "register" and i.positions is not None
               and (i.positions.lineno, i.positions.col_offset) == start for i in instructions)


def _keep(handler: Handler) -> None:
    """Keep ``handler`` for the checkpoints, and give the interpreter, in its place among the
    other handlers (atexit runs last what it got first), a stand-in that runs it only if the
    program ends for good."""
    _handlers.append(handler)
    _REGISTER(_run_if_ended, handler)


def _run_if_ended(handler: Handler) -> None:
    if any(h is handler for h in _ended):
        func, args, kwargs = handler
        func(*args, **kwargs)


def unregister(func: Callable[..., Any]) -> None:
    """`atexit.unregister`: removes ``func`` (compared with ``==``, as atexit does) from both lists."""
    _handlers[:] = [h for h in _handlers if h[0] != func]
    _ended[:] = [h for h in _ended if h[0] != func]
    _UNREGISTER(func)


def install(saved: Optional[list] = None) -> None:
    """Keep the program's handlers from now until `uninstall`; ``saved``: a checkpoint's."""
    _handlers.clear()
    for handler in saved or []:
        _keep(handler)
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
    """The program returned, raised (``ended``: its handlers run at the interpreter's exit, as
    they would have) or stopped for a preemption (they stay in the checkpoint only).

    ``main_globals``: a script's ``__main__`` namespace, cleared after the handlers as the
    interpreter clears ``__main__`` at exit, so the ``__del__`` of its objects (a summary
    printed, a buffer flushed) runs as in a plain run, at the real end only, and while the
    job's output is still captured: the worker's own exit skipped it, or ran it once the
    interpreter had put the original ``sys.stdout`` back, whose lines nobody read."""
    atexit.register, atexit.unregister = _REGISTER, _UNREGISTER  # type: ignore[assignment]
    if ended:
        _ended.extend(_handlers)
        if main_globals is not None:
            _ended_namespace.append(main_globals)
    _handlers.clear()


def _clear_at_the_real_end() -> None:
    """Clears ``__main__`` if the program ended (not if it stopped), after the other handlers.

    The interpreter clears ``__main__`` after every atexit handler, and atexit runs last what it
    got first: so this is registered when this module is imported, which the fork servers and
    the entry points do before torch. Run before torch's handlers (which mark the interpreter as
    exiting), the clearing collected a DataLoader iterator together with its queues, whose
    finalizers stopped the queues' feeder threads; the iterator's shutdown then told its
    persistent workers to exit through dead queues and waited 5 s for each."""
    while _ended_namespace:
        _let_go_like_the_interpreter(_ended_namespace.pop())


_REGISTER(_clear_at_the_real_end)


#: the key of the `_Witness` put in a namespace let go of
WITNESS = "__singularity_witness__"


class _Witness:
    """Alive after a collection: something still holds the namespace it was put in."""


def _let_go_like_the_interpreter(namespace: dict) -> None:
    """What CPython does at exit: the builtins as they were at start put back (a replaced
    ``print`` is not the one ``__del__`` methods find), then ``__main__`` let go of. A script's
    functions and classes hold its dict in a cycle, so the collector finds the dict and what
    only it holds to be garbage, and runs their ``__del__`` methods while every global is still
    there (PEP 442) before it clears them: a ``__del__`` that prints a global's value works.
    Clearing the dict by hand, as this did, emptied it first (``NameError`` in ``__del__``); it
    is still the fallback if something else holds the namespace."""
    finalizers.run_at_exit()  # weakref.finalize(..., atexit=True): its own handler runs before modules go
    _flush_standard_streams()  # as CPython does before it clears modules: a program's Tee still has its globals
    vars(builtins).update(library_patches.PRISTINE_BUILTINS)
    witness = _Witness()
    namespace[WITNESS] = witness
    collected = weakref.ref(witness)
    main = sys.modules.get("__main__")
    if main is not None and vars(main) is namespace:
        del sys.modules["__main__"]
    del main, namespace, witness
    files = _open_files()
    gc.collect()
    del files  # the files nothing else holds go now, by reference counts: each buffer flushes into its open file
    witness = collected()
    if witness is not None:  # still held: clear it by hand
        for holder in gc.get_referrers(witness):
            if isinstance(holder, dict) and holder.get(WITNESS) is witness:
                holder.clear()
                gc.collect()
    _flush_standard_streams(after_clearing=True)


def _open_files() -> list:
    """The files open for writing now, held across the collection of the namespace.

    A file that only the namespace holds (``log = open("train.log", "w")``, never closed) is
    garbage together with it, and the collector finalizes a cycle's objects in no set order: the
    raw file closed before its buffer was flushed, and what the buffer held was lost (an empty log
    where a plain run wrote it all). Held, the files outlive the collection, whatever a
    ``__del__`` writes to them meanwhile reaches them, and when the list goes each goes by its
    reference count, outermost first, flushing into a file still open."""
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)
    # by the type itself: isinstance() would read ``__class__``, which some objects answer with a warning
    return [o for o in gc.get_objects() if issubclass(type(o), kinds) and not _closed(o) and _writable(o)]


def _writable(f: Any) -> bool:
    try:
        return bool(f.writable())
    except Exception:  # noqa: BLE001 - a detached or half-made stream
        return False


def _closed(f: Any) -> bool:
    try:
        return bool(f.closed)
    except Exception:  # noqa: BLE001 - a detached or half-made stream
        return True


def _flush_standard_streams(after_clearing: bool = False) -> None:
    """Flush ``sys.stdout`` and ``sys.stderr``. After the namespace was cleared by hand, a stream
    of the program's own (``sys.stdout = Tee("log.txt")``, whose ``flush`` calls ``os.fsync``)
    may fail for want of its globals: it is then replaced by the interpreter's original, as CPython
    puts those back before it clears modules, so that the interpreter's own last flush does not
    fail and end the process with status 120."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
        except Exception:  # noqa: BLE001 - the program's flush, missing what the clearing took
            if after_clearing:
                setattr(sys, name, getattr(sys, f"__{name}__"))
