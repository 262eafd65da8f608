"""What the rewritten code calls: loop frames, safe points, and the walk back into a restored position.

The hot path is the loop frames' (loops.py): one counter increment, one step increment and one
plain attribute test (``controller.flag``).  Everything else (progress events, checkpoints,
periodic timers) happens only when another thread has raised that flag.

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
from typing import Any, Callable, Optional, Sequence

from . import (closure_cells, frames, held_managers, iterators, library_wrappers, manual_next, open_files,
               process_settings, rng, scoped_modes, spawned, taking)
from ..checkpoint.errors import CheckpointError, Preempted
from .loops import BlockFrame, ForFrame, IfFrame, WhileFrame
from .ports import ControllerView, ProgramView
from .rewrite import MARKER, RT

_get_ident = threading.get_ident


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
    Cells = closure_cells.Cells  # what a function whose closures share its variables keeps them in

    def __init__(self, program: ProgramView, namespace: dict, controller: ControllerView) -> None:
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
        #: names found unpicklable at an earlier checkpoint (state.py tries them last)
        self.unpicklable_cache: dict[str, int] = {}

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
        scoped_modes.apply_inner()  # grad mode, decimal context: as they were at the safe point
        manual_next.warn_reopened()  # files a with statement opened again that no loop put back in place
        self.restoring = False
        self._path = []
        self._saved_scope = {}
        self.ctl.last_restore = {"step": self.step, "seconds": time.monotonic() - self.restore_started,
                                 "rebuilt": list(self.rebuilt)}
        # Reported here, when the position is reached, not when loading begins: "resumed" then
        # means the next iteration is the first new one (migration times are measured to it).
        self.ctl.emit("resumed", dict(self.ctl.last_restore))

    def go(self, node: int) -> bool:
        return self._path[self._depth]["node"] == node

    def go_any(self, nodes: tuple) -> bool:
        return self._path[self._depth]["node"] in nodes

    # ------------------------------------------------------------------ torch.multiprocessing.spawn (spawned.py)
    def spawns_ranks(self, nprocs: Any) -> bool:
        return spawned.spawns_ranks(nprocs)

    def spawned_rank(self) -> int:
        return spawned.rank_of_spawned()

    def spawn_joined(self, _returned: Any) -> None:
        spawned.joined()

    def restored_locals(self) -> dict:
        return self._restored_locals or {}

    # ------------------------------------------------------------------ re-entering user functions
    def reenter(self, node: int, fn: Any, *runs: Any, **options: Any) -> Any:
        """Call the function a checkpointed frame was running, as the call site ``node`` did, but
        with placeholder arguments: its prologue (`arrive`) loads the saved locals instead. A
        command-line entry point (`library_wrappers`: ``main()`` of a click command, ``fire.Fire(main)``)
        is called with the call site's own arguments (``runs``, ``options``): it parses the job's
        ``sys.argv`` again and calls the function, which then arrives."""
        rec, _ = self._take(node)
        if not any(self.program.fid_of(code) == rec["function"] for code in frames.reached_codes(fn, runs)):
            raise CheckpointError(
                f"restore re-entered the call at line {rec['line']}, but it now calls {fn!r}, not the "
                f"function {self.program.defs[rec['function']].name}() the checkpoint was taken in")
        self._arriving = rec
        if library_wrappers.entry_targets(fn, runs) is not None:
            return fn(*runs, **options)
        func, bound = frames.function_of(fn)
        assert func is not None
        code = library_wrappers.unwrap(func).__code__  # type: ignore[union-attr]
        value = library_wrappers.placeholder(func)
        positional = [value] * (code.co_argcount - len(bound))
        keywords = {k: value for k in code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]}
        return func(*bound, *positional, **keywords)

    def reenter_method(self, node: int, method: str) -> Any:
        """`reenter` for ``Trainer(cfg).fit()``: the receiver is the one the checkpointed frame of
        the method holds (its first argument), not a new object from the receiver's expression."""
        rec = self._path[self._depth]
        definition = self.program.defs.get(rec.get("function"))
        name = definition.receiver if definition is not None else ""
        if rec.get("node") != node or name not in rec.get("locals", {}):
            raise CheckpointError(
                f"restore re-entered the call of .{method}() at line {rec.get('line', '?')}, but the "
                f"checkpoint holds no receiver for it: the program differs from the one checkpointed")
        return self.reenter(node, getattr(rec["locals"][name], method))

    def arrive(self, marker: str) -> Any:
        """Prologue of a rewritten function called while ``restoring``: None for the call a restore
        re-enters (its locals are loaded next); for any other call (a ``with`` header, an iterator
        re-created on restore) the restore pauses until it returns, and a token is returned."""
        rec = self._arriving
        if rec is not None and marker == f"{MARKER}{rec['function']}":
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
            digests: dict = {}
            extra: dict = {}
            it = iterators.rebuild(rec["source"], rec["fetched"], makers, texts, info.line, digests, extra)
            frame = ForFrame(self, node, it, None, rec["source"], rec["fetched"],
                             "target" if last else "inside", rec.get("current"), digests, extra)
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
            rec, _ = self._take(node)
            return BlockFrame(self, node, "with", rec.get("files"), scoped_modes.current(), rec.get("held"),
                              rec.get("rng"))
        return BlockFrame(self, node, "with", None, scoped_modes.current())

    def enter_try(self, node: int) -> BlockFrame:
        if self._elsewhere():
            return BlockFrame(DORMANT, node, "try")
        if self.restoring:
            self._take(node)
        return BlockFrame(self, node, "try")

    def with_ctx(self, node: int, manager: Any) -> Any:
        """Each context manager of a with statement's header, as it is made: kept on the frame,
        so a checkpoint can save the files it wrote; on restore, the checkpoint's handle of such a
        file (which running the header again just truncated) takes the new one's place, with its
        saved bytes and position."""
        if self._elsewhere():
            return manager
        frame = self.stack[-1] if self.stack else None
        if not isinstance(frame, BlockFrame) or frame.node != node:
            return manager
        index = len(frame.managers)
        frame.managers.append(manager)
        if held_managers.is_held(manager):  # the job's own, an ExitStack: held across stops
            held = frame.saved_held[index] if self.restoring and index < len(frame.saved_held) else None
            if held is None:
                held = held_managers.HeldManager(manager, self)
            held.runtime = self
            frame.managers[index] = held
            return held
        if frame.settings_before is None and process_settings.switches_settings(manager):
            frame.settings_before = scoped_modes.settings_now()  # what it will put back at its end
        if rng.forks(manager):  # torch.random.fork_rng: what it will put back is what it finds now
            if self.restoring and frame.rng_before and index in frame.rng_before:
                rng.apply(frame.rng_before[index])  # the checkpoint's generators are set at the safe point
            else:
                frame.rng_before = {**(frame.rng_before or {}), index: rng.capture()}
        if not self.restoring or not isinstance(manager, io.IOBase):
            return manager
        line = self.program.nodes[node].line
        saved = frame.saved_files[index] if index < len(frame.saved_files) else None
        if isinstance(saved, tuple):  # a file read from with readline()/read(): where it was
            manager.seek(saved[1])
        elif saved is not None:
            manager = frame.managers[index] = open_files.take_over(manager, saved, f"the with statement at line {line}")
        else:  # a file a loop was reading: the loop takes its place back, else the restore warns
            manual_next.reopened(manager, line)
        return manager

    def next_item(self, it: Any, *default: Any) -> Any:
        """The program's ``next(it[, default])`` (the rewrite renames it): counted, so a restore
        that re-creates ``it`` takes the same items again (manual_next.py)."""
        try:
            item = manual_next.next_line(it, default) if manual_next.is_text_file(it) else next(it)
        except StopIteration:
            if default:
                return default[0]
            raise
        if not self._elsewhere():
            manual_next.took(self.stack, it, item)
        return item

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
            self.ctl.unusable(chain)
            if self.ctl.poll_progress():
                self.ctl.emit("progress", {"step": self.step, "loops": self.loop_counters()})
            return
        request, progress = self.ctl.poll(self)
        if progress:
            self.ctl.emit("progress", {"step": self.step, "loops": self.loop_counters()})
        if self.ctl.tracer is not None:
            self.ctl.tracer(self.step, self.describe_position(boundary, chain))
        if request is not None:
            self.chain = chain
            try:
                taking.take(self, request, boundary)
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


_REENTER_CODE = frozenset({Runtime.reenter.__code__, Runtime.reenter_method.__code__})


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
