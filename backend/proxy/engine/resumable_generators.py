"""Saving a suspended generator of the program, and making it again at a restore.

A generator function rewritten by `generator_rewrite` records which yield it is suspended at
(its local ``__sg_at__``) and keeps in a `GeneratorState` (``__sg_g__``) the live iterator of each
``for`` loop it is inside. A checkpoint saves the function, the frame's locals, that yield and
those iterators (`reduce`); the restore calls the function again and its first ``next()`` runs
the body in restoring mode: the locals are loaded, the loops around the recorded yield are
entered with their saved iterators, every other statement is skipped, and execution goes on just
after that yield (`resume`). The iterators are pickled like any other object of the job, so a
DataLoader iterator comes back at its batch with its workers' generators (training_state.py).
"""
from __future__ import annotations

import inspect
import io
import itertools
import sys
import types
from typing import Any, Iterator, Optional

from . import manual_next
from .generator_rewrite import AT, LOCALS, RESTORING, STATE
#: id(frame) -> (the generator, its saved state): generators `resume` made, until their first
#: ``next()`` takes the state (`begin`); holding the generator keeps the id from being reused
_RESUMING: dict[int, tuple[types.GeneratorType, "_Saved"]] = {}


class _Saved:
    """What a checkpoint holds of a generator besides its function."""

    def __init__(self, local_values: dict, at: int, loops: dict[int, Iterator[Any]], managers: dict[int, Any]) -> None:
        self.local_values, self.at, self.loops, self.managers = local_values, at, loops, managers


class GeneratorState:
    """The running state of one rewritten generator (its local ``__sg_g__``)."""

    __slots__ = ("restoring", "locals", "at", "loops", "managers", "_on")

    def __init__(self, paths: dict, saved: Optional[_Saved]) -> None:
        self.at = 0  # the yield it is suspended at (0: none yet)
        self.loops: dict[int, Iterator[Any]] = {}  # the iterators of the loops it is inside
        self.managers: dict[int, Any] = {}  # the context managers of the with statements it is inside
        self.restoring = saved is not None and saved.at != 0
        self.locals = saved.local_values if saved is not None else None
        self._on: dict[int, bool] = {}
        if saved is not None and saved.at:
            self.loops, self.managers = dict(saved.loops), dict(saved.managers)
            self._on = {nid: branch for nid, branch in paths[saved.at]}
            self.at = saved.at

    # the calls the rewritten body makes -------------------------------------------------------
    def on_path(self, nid: int) -> bool:
        return nid in self._on

    def branch(self, nid: int) -> bool:
        return self._on[nid]

    def enter_for(self, nid: int, iterable: Any) -> Iterator[Any]:
        # a text file's lines through readline(), so that its tell() keeps working (manual_next.py)
        it = self.loops[nid] = manual_next.reader_of(iterable)
        return it

    def resume_for(self, nid: int, first: tuple) -> Iterator[Any]:
        return itertools.chain(first, self.loops[nid])

    def leave(self, nid: int) -> None:
        self.loops.pop(nid, None)

    def enter_with(self, nid: int, manager: Any) -> Any:
        entered = type(manager).__enter__(manager)
        self.managers[nid] = manager
        return entered

    def exit_with(self, nid: int, raised: bool) -> bool:
        """Leave the ``with`` statement ``nid`` (once); ``raised``: with the exception being handled.
        Whether its manager swallows that exception."""
        manager = self.managers.pop(nid, None)
        if manager is None:
            return False
        return bool(type(manager).__exit__(manager, *(sys.exc_info() if raised else (None, None, None))))

    def arrive(self, yid: int) -> bool:
        """Restoring, at yield ``yid``: whether the restore goes on (it ends at the recorded one)."""
        if yid == self.at:
            self.restoring = False
            self.locals = None
        return self.restoring


def begin(paths: dict) -> GeneratorState:
    """The state of the generator whose body calls this (its first statement)."""
    frame = sys._getframe(1)
    pending = _RESUMING.pop(id(frame), None)
    return GeneratorState(paths, pending[1] if pending is not None and pending[0].gi_frame is frame else None)


# --------------------------------------------------------------------------- checkpoint time
def is_resumable(obj: Any) -> bool:
    """Whether ``obj`` is a generator that `reduce` saves where it stopped."""
    return isinstance(obj, types.GeneratorType) and reduce(obj) is not None


def keeps_place(gen: Any) -> bool:
    """Whether every checkpoint can save ``gen`` where it is: a generator generator_rewrite
    rewrote, or a finished one. An unstarted generator of any other function pickles too (it is
    made again from its arguments), but a loop's description is kept across restores, and once
    the loop takes an item from it no later checkpoint could (`tqdm(loader)`'s ``__iter__``)."""
    return is_resumable(gen) and (gen.gi_frame is None or STATE in gen.gi_code.co_varnames)


def reduce(gen: types.GeneratorType) -> Optional[tuple]:
    """How to pickle ``gen``; None when it cannot be (not rewritten, or running)."""
    frame = gen.gi_frame
    if frame is None:  # finished: next() raises StopIteration, and so will the restored one's
        return _empty, ()
    if gen.gi_running:
        return None
    func = _function_of(gen)
    if func is None:
        return None
    pending = _RESUMING.get(id(frame))
    if pending is not None and pending[0] is gen and inspect.getgeneratorstate(gen) == inspect.GEN_CREATED:
        # restored, not started again yet
        saved = pending[1]
        return resume, (func, saved.local_values, saved.at, saved.loops, saved.managers)
    values = frame.f_locals
    state = values.get(STATE)
    if inspect.getgeneratorstate(gen) == inspect.GEN_CREATED:
        return resume, (func, dict(values), 0, {}, {})
    if not isinstance(state, GeneratorState):
        return None  # a generator function that runs unchanged (generator_rewrite.why_not)
    if not all(isinstance(m, io.IOBase) for m in state.managers.values()):
        return None  # a manager whose __enter__ a restore would not run again (a mode, a lock)
    kept = {k: v for k, v in values.items() if k not in (STATE, LOCALS, RESTORING, AT)}
    return resume, (func, kept, values.get(AT, 0), dict(state.loops), dict(state.managers))


def _function_of(gen: types.GeneratorType) -> Optional[types.FunctionType]:
    """The module-level function (or method of a module-level class) that made ``gen``."""
    code = gen.gi_code
    parts = code.co_qualname.split(".")
    if "<locals>" in parts:
        return None
    obj: Any = gen.gi_frame.f_globals.get(parts[0])
    for part in parts[1:]:
        obj = obj.__dict__.get(part) if isinstance(obj, type) else None
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    while isinstance(obj, types.FunctionType) and obj.__code__ != code and hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__  # @contextmanager's helper: the generator function it calls
    # equal, not identical: unpickling a class by value in the process that defined it (a restore
    # in place) puts copies of its methods on it (cloudpickle's class tracking)
    return obj if isinstance(obj, types.FunctionType) and obj.__code__ == code else None


# --------------------------------------------------------------------------- restore time
def resume(func: types.FunctionType, local_values: dict, at: int, loops: dict, managers: dict) -> types.GeneratorType:
    """``func``'s generator again; its first ``next()`` goes on after yield ``at`` (0: from its
    start, with ``local_values`` as its arguments)."""
    code = func.__code__
    names = code.co_varnames
    positional = code.co_argcount
    kwonly = code.co_kwonlyargcount
    args = [local_values.get(n) for n in names[:positional]]
    if code.co_flags & inspect.CO_VARARGS:
        args += list(local_values.get(names[positional + kwonly], ()))
    kwargs = {n: local_values.get(n) for n in names[positional:positional + kwonly]}
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = names[positional + kwonly + bool(code.co_flags & inspect.CO_VARARGS)]
        kwargs.update(local_values.get(extra, {}))
    gen = func(*args, **kwargs)
    if STATE in code.co_varnames:  # its first next() takes the saved state (`begin`); no other does
        _RESUMING[id(gen.gi_frame)] = (gen, _Saved(local_values, at, loops, managers))
    return gen


def _empty() -> Iterator[Any]:
    return
    yield  # noqa: unreachable - makes this a generator function
