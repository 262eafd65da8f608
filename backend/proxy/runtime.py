"""What the rewritten code calls: loop frames, safe points, and the walk back into a restored position.

The hot path is `ForFrame.__next__` / `WhileFrame.tick`: one counter increment, one step
increment and one plain attribute test (``controller.flag``).  Everything else (progress events,
checkpoints, periodic timers) happens only when another thread has raised that flag.

Frames form a stack that mirrors the tracked statements currently executing; at a safe point
the stack *is* the position.  On restore the recorded path is walked again: guarded statements
are skipped while ``restoring`` is true, tracked statements on the path consume their record
(``go``/``enter_*``), and the innermost record rebuilds its iterator, resets the RNGs and turns
``restoring`` off.
"""
from __future__ import annotations

import builtins
import io
import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from . import background, frames, iterators, rng
from .errors import CheckpointError, CheckpointFailure, Preempted
from .rewrite import RT

_get_ident = threading.get_ident

if TYPE_CHECKING:  # pragma: no cover
    from .controller import Controller, CheckpointRequest
    from .program import ResumableProgram


class ForFrame:
    """A running ``for`` loop: counts fetched items; its ``__next__`` is the safe point."""

    __slots__ = ("rt", "ctl", "node", "it", "source", "desc", "fetched", "current", "pending")
    kind = "for"

    def __init__(self, rt: "Runtime", node: int, it: Iterator[Any], source: Optional[iterators.LoopSource],
                 desc: Optional[dict], fetched: int, pending: Optional[str] = None, current: Any = None) -> None:
        self.rt = rt
        self.ctl = rt.ctl
        self.node = node
        self.it = it
        self.source = source
        self.desc = desc
        self.fetched = fetched
        self.current = current
        self.pending = pending

    def __iter__(self) -> "ForFrame":
        return self

    def __next__(self) -> Any:
        if self.pending is not None:
            return self._resume()
        rt = self.rt
        rt.step += 1
        if self.ctl.flag:
            rt.safe_point(None)
        item = next(self.it)
        self.fetched += 1
        self.current = item
        return item

    def _resume(self) -> Any:
        """First ``next()`` after a restore: no safe point, it was taken before the checkpoint."""
        pending, self.pending = self.pending, None
        if pending == "inside":  # resuming inside the body: hand the same item back
            return self.current
        item = next(self.it)
        self.fetched += 1
        self.current = item
        return item

    @property
    def count(self) -> int:
        return self.fetched


class WhileFrame:
    """A running ``while`` loop; ``tick()`` runs before each test of its condition."""

    __slots__ = ("rt", "ctl", "node", "ticks", "pending")
    kind = "while"

    def __init__(self, rt: "Runtime", node: int, ticks: int = 0, pending: Optional[str] = None) -> None:
        self.rt = rt
        self.ctl = rt.ctl
        self.node = node
        self.ticks = ticks
        self.pending = pending

    def tick(self) -> bool:
        """Return True only to re-enter the body without re-testing the condition (restore)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if pending == "inside":
                return True
            self.ticks += 1
            return False
        rt = self.rt
        rt.step += 1
        if self.ctl.flag:
            rt.safe_point(None)
        self.ticks += 1
        return False

    @property
    def count(self) -> int:
        return self.ticks


class IfFrame:
    __slots__ = ("node", "branch")
    kind = "if"

    def __init__(self, node: int, branch: bool) -> None:
        self.node = node
        self.branch = branch


class BlockFrame:
    """Frame of a ``with`` or ``try`` body; a context manager so Python pops it on any exit."""

    __slots__ = ("rt", "node", "kind")

    def __init__(self, rt: "Runtime", node: int, kind: str) -> None:
        self.rt = rt
        self.node = node
        self.kind = kind

    def __enter__(self) -> "BlockFrame":
        self.rt.stack.append(self)
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        stack = self.rt.stack
        if stack and stack[-1] is self:
            stack.pop()
        if et is None and self.rt.preempted_exc is not None:
            raise self.rt.preempted_exc  # a context manager inside swallowed the preemption
        return False


class _NoStack(list):
    """The stack of the `dormant` runtime: nothing is ever recorded."""

    def append(self, item: Any) -> None:
        pass


class _Idle:
    flag = False


class Runtime:
    """Per-run state shared by the rewritten code (as ``__sg_rt__``) and the checkpoint writer.

    Only the thread that runs the program records loops; rewritten functions that run in other
    threads (or after the run ended) use the `dormant` runtime: no safe points, no bookkeeping.
    """

    Preempted = Preempted

    def __init__(self, program: "ResumableProgram", namespace: dict, controller: "Controller") -> None:
        self.program = program
        self.ns = namespace
        self.ctl = controller
        self.step = 0
        self.restoring = False
        self.preempting = False
        self.preempted_exc: Optional[Preempted] = None
        self.stack: list[Any] = []  # ForFrame | WhileFrame | IfFrame | BlockFrame
        self._thread = _get_ident()
        self._pid = os.getpid()
        #: the user frames of the safe point being checkpointed (`frames.user_chain`)
        self.chain: Optional[list[frames.UserFrame]] = None
        self._arriving: Optional[dict] = None  # the call record a restore is re-entering
        self._frame_locals: dict = {}
        self._paused = 0  # calls made during a restore that run as plain code
        self.result: Any = None
        self.fn_frame: Any = None
        self.fn_globals: Optional[dict] = None
        self.rebuilt: list[str] = []
        self._path: list[dict] = []
        self._depth = 0
        self._restore_rng: Optional[dict] = None
        self._restored_locals: Optional[dict] = None
        self._saved_scope: dict = {}
        self.restore_started = 0.0  # set by the program before it loads the checkpoint
        self._unpicklable_cache: dict[str, int] = {}

    # ------------------------------------------------------------------ restore navigation
    def begin_restore(self, path: list[dict], step: int, rng_state: dict, saved_locals: Optional[dict],
                      saved_scope: dict) -> None:
        """Arm the walk back to ``path``; ``saved_scope`` holds the checkpointed variables."""
        self.restoring = bool(path)
        self._saved_scope = saved_scope
        self._path = path
        self._depth = 0
        self.step = step
        self._restore_rng = rng_state
        self._restored_locals = saved_locals
        if not path:
            self._finish_restore()

    def _take(self, node: int) -> tuple[dict, bool]:
        rec = self._path[self._depth]
        if rec["node"] != node:
            raise CheckpointError(f"restore walked into statement {node}, but the checkpoint records "
                                  f"{rec['node']}: the program differs from the one checkpointed")
        self._depth += 1
        return rec, self._depth == len(self._path)

    def _finish_restore(self) -> None:
        rng.apply(self._restore_rng)
        self.restoring = False
        self._path = []
        self._saved_scope = {}
        self.ctl.last_restore = {"step": self.step, "seconds": time.monotonic() - self.restore_started,
                                 "rebuilt": list(self.rebuilt)}
        # Reported here, when the position is reached, not when loading begins: "resumed" then
        # means the next iteration is the first new one (migration times are measured to it).
        self.ctl._emit("resumed", dict(self.ctl.last_restore))

    def go(self, node: int) -> bool:
        return self._path[self._depth]["node"] == node

    def go_any(self, nodes: tuple) -> bool:
        return self._path[self._depth]["node"] in nodes

    def restored_locals(self) -> dict:
        return self._restored_locals or {}

    # ------------------------------------------------------------------ re-entering user functions
    def reenter(self, node: int, fn: Any) -> Any:
        """Call the function a checkpointed frame was running, as the call site ``node`` did, but
        with placeholder arguments: its prologue (`arrive`) loads the saved locals instead."""
        rec, _ = self._take(node)
        func, bound = frames.function_of(fn)
        if func is None or self.program.fid_of(func.__code__) != rec["function"]:
            raise CheckpointError(
                f"restore re-entered the call at line {rec['line']}, but it now calls {fn!r}, not the "
                f"function {self.program.defs[rec['function']].name}() the checkpoint was taken in")
        code = func.__code__
        positional = [None] * (code.co_argcount - len(bound))
        keywords = {k: None for k in code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]}
        self._arriving = rec
        return func(*bound, *positional, **keywords)

    def arrive(self, marker: str) -> Any:
        """Prologue of a rewritten function called while ``restoring``: None for the call a restore
        re-enters (its locals are loaded next); for any other call (a ``with`` header, an iterator
        re-created on restore) the restore pauses until it returns, and a token is returned."""
        rec = self._arriving
        if rec is not None:
            self._arriving = None
            self._frame_locals = rec["locals"]
            self._saved_scope = rec["locals"]
            return None
        self.restoring = False
        self._paused += 1
        return self.step

    def resume(self, token: int) -> None:
        """End of a call `arrive` paused the restore for: it continues where it was."""
        self._paused -= 1
        self.step = token
        self.restoring = True

    def frame_locals(self) -> dict:
        return self._frame_locals

    def saved(self, name: str, current: Any) -> Any:
        """The checkpointed value of a loop target re-assigned while walking back in."""
        return self._saved_scope.get(name, current)

    # ------------------------------------------------------------------ called by generated code
    def set_result(self, value: Any) -> None:
        self.result = value

    def enter_function(self) -> None:
        self.fn_frame = sys._getframe(1)

    def _elsewhere(self) -> bool:
        """Another thread runs rewritten code: it gets the dormant runtime's frames."""
        return _get_ident() != self._thread

    def leaf(self, index: int, value: Any) -> iterators.Leaf:
        return iterators.Leaf(index, value)

    def node(self, index: int, fn: Any, children: tuple, kwargs: dict) -> Any:
        return iterators.make_node(index, fn, children, kwargs)

    def enter_for(self, node: int, src: Any, makers: Sequence[Optional[Callable[[], Any]]]) -> ForFrame:
        if self._elsewhere():
            return DORMANT.enter_for(node, src, makers)
        if self.restoring:
            rec, last = self._take(node)
            info = self.program.nodes[node]
            texts = [leaf.text for leaf in info.leaves]
            it = iterators.rebuild(rec["source"], rec["fetched"], makers, texts, info.line)
            frame = ForFrame(self, node, it, None, rec["source"], rec["fetched"],
                             "target" if last else "inside", rec.get("current"))
            if last:
                self._finish_restore()
        else:
            source = iterators.LoopSource.start(src)
            frame = ForFrame(self, node, source.iterator, source, None, 0)
        self.stack.append(frame)
        return frame

    def enter_while(self, node: int) -> WhileFrame:
        if self._elsewhere():
            return DORMANT.enter_while(node)
        if self.restoring:
            rec, last = self._take(node)
            frame = WhileFrame(self, node, rec["ticks"], "target" if last else "inside")
            if last:
                self._finish_restore()
        else:
            frame = WhileFrame(self, node)
        self.stack.append(frame)
        return frame

    def enter_if(self, node: int, value: Optional[bool]) -> bool:
        if self._elsewhere():
            return bool(value)
        if self.restoring:
            rec, _ = self._take(node)
            value = rec["branch"]
        self.stack.append(IfFrame(node, bool(value)))
        return bool(value)

    def enter_with(self, node: int) -> BlockFrame:
        if self._elsewhere():
            return BlockFrame(DORMANT, node, "with")
        if self.restoring:
            self._take(node)
        return BlockFrame(self, node, "with")

    def enter_try(self, node: int) -> BlockFrame:
        if self._elsewhere():
            return BlockFrame(DORMANT, node, "try")
        if self.restoring:
            self._take(node)
        return BlockFrame(self, node, "try")

    def with_ctx(self, node: int, manager: Any) -> Any:
        if self.restoring and isinstance(manager, io.IOBase):
            line = self.program.nodes[node].line
            warnings.warn(
                f"restore re-entered the with statement at line {line}, which re-opened "
                f"{getattr(manager, 'name', manager)!r}: reads and writes through it start where the "
                f"header leaves them, not where they were at the checkpoint (a for loop over it is "
                f"advanced back to its item)", RuntimeWarning, stacklevel=2)
        return manager

    def pop(self, node: int) -> None:
        stack = self.stack
        if stack and stack[-1].node == node and not self._elsewhere():
            stack.pop()

    def boundary(self, node: int) -> None:
        if self.restoring:
            self._take(node)
            self._finish_restore()
            return
        self.step += 1
        if self.ctl.flag:
            self.safe_point(node)

    # ------------------------------------------------------------------ safe points
    def loop_counters(self) -> list[int]:
        return [f.count for f in self.stack if isinstance(f, (ForFrame, WhileFrame))]

    def safe_point(self, boundary: Optional[int]) -> None:
        """Slow path, entered only when the controller raised its flag."""
        chain = self._user_chain()
        if isinstance(chain, str):  # not usable: requests wait for the next usable safe point
            if self.ctl._poll_progress():
                self.ctl._emit("progress", {"step": self.step, "loops": self.loop_counters()})
            return
        request, progress = self.ctl._poll(self)
        if progress:
            self.ctl._emit("progress", {"step": self.step, "loops": self.loop_counters()})
        if self.ctl._trace is not None:
            self.ctl._trace(self.step, self.describe_position(boundary, chain))
        if request is not None:
            self.chain = chain
            try:
                self._checkpoint(request, boundary)
            finally:
                self.chain = None

    def _user_chain(self) -> "list[frames.UserFrame] | str":
        if self._paused or os.getpid() != self._pid:
            return "a restore is running a call that is not on its path, or this is a forked process"
        return frames.user_chain(self.program, self.stack, sys._getframe(2), _REENTER_CODE)

    def describe_position(self, boundary: Optional[int], chain: Optional[list] = None) -> dict:
        """A JSON-friendly summary of where the program is (for traces and progress)."""
        nodes = self.program.nodes
        if boundary is not None:
            return {"kind": "boundary", "line": nodes[boundary].line, "loops": []}
        top = self.stack[-1] if self.stack else None
        line = nodes[top.node].line if top is not None else 0
        out = {"kind": "loop", "line": line, "loops": self.loop_counters()}
        if chain is not None and len(chain) > 1:
            out["functions"] = [self.program.defs[u.fid].name for u in chain[1:]]
        return out

    def _checkpoint(self, request: "CheckpointRequest", boundary: Optional[int]) -> None:
        from .state import write_checkpoint

        ctl = self.ctl
        started = time.monotonic()
        wait_s = max(0.0, started - request.requested_at)
        label = self.step if request.label is None else request.label
        ctl._emit("checkpoint_started", {"step": label, "reason": request.reason, "then": request.then})
        failure: Optional[dict] = None
        try:
            if background.applies(self, request):  # snapshot now; write and report behind the loop
                background.checkpoint(self, boundary, label, started, wait_s)
                return
            ref, nbytes, rebuilt = write_checkpoint(self, boundary, label)
        except CheckpointFailure as e:
            failure = {"error": str(e), "variables": e.variables}
        except Exception as e:  # disk full, permissions...: report, keep running
            failure = {"error": f"{type(e).__name__}: {e}", "variables": []}
        if failure is not None:
            ctl._emit("checkpoint_failed", failure)
        if not ctl._all_written(failure is None) or failure is not None:
            return  # every rank of the job runs on: none stops at a checkpoint another rank lacks
        ctl._checkpoint_written()
        ctl._emit("checkpointed", {"step": label, "bytes": nbytes, "seconds": time.monotonic() - started,
                                   "wait_s": wait_s, "path": str(ref.path), "rebuilt": rebuilt})
        if request.then == "stop":
            self.preempting = True
            self.preempted_exc = Preempted(ref)
            raise self.preempted_exc


_REENTER_CODE = Runtime.reenter.__code__


class _DormantRuntime(Runtime):
    """What rewritten functions use outside the program's run (other threads, after it ended):
    loops run as plain loops, with nothing recorded and no safe point taken."""

    def __init__(self) -> None:
        self.ctl = _Idle()  # type: ignore[assignment]
        self.step = 0
        self.restoring = False
        self.preempting = False
        self.preempted_exc = None
        self.stack = _NoStack()
        self._thread = -1

    def _elsewhere(self) -> bool:
        return False


#: the runtime of rewritten functions called when no program runs (see `install_dormant`)
DORMANT = _DormantRuntime()


def install_dormant() -> None:
    """Make ``__sg_rt__`` resolve, through builtins, to `DORMANT` where a program's namespace no
    longer has it: functions of a finished run (a returned model, a callback) still work."""
    setattr(builtins, RT, DORMANT)
