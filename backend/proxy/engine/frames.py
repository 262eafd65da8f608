"""Which user-code frames stand between the top level and a safe point, found when one is used.

A safe point inside a function is usable only if every frame from the program's top level down
to it is a rewritten frame of the program, each entered from a call site the rewrite marked in
its caller (so a restore can re-enter it without evaluating the call's arguments again). This is
checked on the slow path only, from the Python frames themselves: calling a function costs
nothing extra. A library frame in between (``model(x)`` reaching a ``forward`` with a loop, a
``sorted(key=...)`` callback, a decorator's wrapper other than the few `library_wrappers` lets a
restore call again, a generator), recursion, or a call the rewrite cannot re-enter makes the
safe point unusable: a pending request then waits for the
next usable one, which at the latest is the first safe point after that call returns.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Optional, Union

from . import grad_decorators, library_wrappers
from .ports import ProgramView

_positions: dict[types.CodeType, list] = {}


@dataclass
class UserFrame:
    """One frame of the program on the way to a safe point; ``call`` leads to the next one."""

    fid: int
    frame: types.FrameType
    entries: list  # the runtime's stack entries (loops, branches, blocks) of this frame
    call: Optional[int] = None
    #: the caller's grad mode, where a ``@torch.no_grad()`` stands between it and this frame (`grad_decorators`)
    grad_before: Optional[bool] = None


def function_of(fn: Any) -> tuple[Optional[types.FunctionType], tuple]:
    """The Python function a call of ``fn`` runs first, and the arguments a method binds."""
    if isinstance(fn, functools.partial):  # a C-level call: no frame of its own stands in between
        func, bound = function_of(fn.func)
        return func, bound + tuple(fn.args)
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return fn.__func__, (fn.__self__,)
    if isinstance(fn, types.FunctionType):
        return fn, ()
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType) and not isinstance(fn, type):  # `trainer(epochs)`: its __call__
        return call, (fn,)
    return None, ()


def _between(library: types.FrameType, below: Optional[types.FrameType]) -> str:
    """Why a library frame makes the safe points below it unusable, with what to do when it is a
    decorator's wrapper of the program's function (it holds that function)."""
    why = f"a library function ({library.f_code.co_qualname}) stands between two frames of the program"
    wrapped = below is not None and any(isinstance(v, types.FunctionType) and v.__code__ is below.f_code
                                        for v in library.f_locals.values())
    if wrapped:
        why += (f": a decorator's wrapper of {below.f_code.co_name}(), which a restore cannot call again "
                f"(for `@torch.autocast(...)` and the like, put the loop in a `with` block of that context "
                f"manager instead)")
    return why


def _call_at(program: ProgramView, fid: int, frame: types.FrameType) -> Optional[int]:
    """The call site (node id) a frame is executing, from its current instruction's source span."""
    code = frame.f_code
    table = _positions.get(code)
    if table is None:
        table = _positions[code] = list(code.co_positions())
    index = frame.f_lasti // 2
    if not 0 <= index < len(table):
        return None
    return program.call_spans.get(fid, {}).get(tuple(table[index]))


def _callee_matches(program: ProgramView, cid: int, caller: types.FrameType, callee: types.FrameType) -> bool:
    """Whether the call site's callee expression, evaluated in the caller, is the callee's function;
    for a method of a temporary (``Trainer(cfg).fit()``), the method of the callee's receiver."""
    info = program.nodes[cid]
    try:
        if info.method:
            code = callee.f_code  # the receiver is its first parameter (`DefInfo.receiver`)
            if not code.co_argcount or code.co_varnames[0] not in callee.f_locals:
                return False
            fn = getattr(callee.f_locals[code.co_varnames[0]], info.method)
        else:
            fn = eval(info.callee, caller.f_globals, caller.f_locals)  # a name or an attribute chain (see rewrite)
        runs = (eval(info.runs, caller.f_globals, caller.f_locals),) if info.runs else ()
    except Exception:
        return False
    if library_wrappers.is_command(fn) and not info.bare:
        return False  # called again, a command gets no arguments (`library_wrappers`)
    return callee.f_code in reached_codes(fn, runs)


def reached_codes(fn: Any, runs: tuple = ()) -> list[types.CodeType]:
    """The code of the program's function a call of ``fn`` arrives in: through ``@record`` (its
    wrapper is called again), a command's callbacks, a runner's argument (`library_wrappers`)."""
    targets = library_wrappers.entry_targets(fn, runs)
    funcs = (library_wrappers.unwrap(function_of(t)[0]) for t in (targets if targets is not None else [fn]))
    return [f.__code__ for f in funcs if f is not None]


def user_chain(program: ProgramView, stack: list, start: Optional[types.FrameType],
               transparent: frozenset[types.CodeType]) -> Union[list[UserFrame], str]:
    """The user frames from the top level down to ``start``'s innermost program frame, outermost
    first, each with its share of ``stack``; or a string saying why this safe point is unusable.

    ``transparent`` holds the codes of `Runtime.reenter` (and `Runtime.reenter_method`, which calls
    it), which stand between a caller and its callee after a restore re-entered the call.
    """
    f = start
    while f is not None and program.fid_of(f.f_code) is None:
        f = f.f_back
    chain: list[UserFrame] = []
    while f is not None:
        fid = program.fid_of(f.f_code)
        if fid is None:
            return _between(f, chain[-1].frame if chain else None)
        user = UserFrame(fid, f, [])
        chain.append(user)
        if fid == 0:
            break
        caller = f.f_back
        while caller is not None and (caller.f_code in transparent
                                      or library_wrappers.is_wrapper_code(caller.f_code)):
            mode = grad_decorators.caller_mode(caller)
            if mode is not None:
                user.grad_before = mode  # the outermost of stacked decorators is seen last
            caller = caller.f_back
        f = caller
    else:
        return "the safe point is not inside the program"
    chain.reverse()
    seen = [u.fid for u in chain]
    if len(set(seen)) != len(seen):
        return "a function of the program is active more than once (recursion)"
    for outer, inner in zip(chain, chain[1:]):
        cid = _call_at(program, outer.fid, outer.frame)
        if cid is None or not _callee_matches(program, cid, outer.frame, inner.frame):
            name = program.defs[inner.fid].name
            return f"{name}() was not called from a call the restore can re-enter (line {outer.frame.f_lineno})"
        outer.call = cid
    # each frame's share of the stack: entries are in order and belong to the frames in order
    nodes = program.nodes
    i = 0
    for u in chain:
        while i < len(stack) and nodes[stack[i].node].func == u.fid:
            u.entries.append(stack[i])
            i += 1
    if i != len(stack):
        return "loop bookkeeping of a function outside this call chain is active"
    return chain
