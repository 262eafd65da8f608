"""Where a running program is, from outside it: the answer to a checkpoint that timed out.

A request that finds no safe point within its bound is answered with the place the program is
stuck in, so the user can tell "inside `time.sleep`, called at train.py:12 in `main`" from "the
engine hangs". The program's thread is sampled with ``sys._current_frames()`` from another
thread; nothing is stopped or traced.
"""
from __future__ import annotations

import ast
import linecache
import os
import sys
from types import FrameType
from typing import Any, Optional

#: the proxy's own folder (all its layers): its frames are not where the job "is"
_ENGINE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_engine(path: str) -> bool:
    return os.path.abspath(path).startswith(_ENGINE)


def _module_name(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or os.path.basename(frame.f_code.co_filename))


def _call_in_progress(frame: FrameType) -> Optional[str]:
    """The function a frame is calling right now (``time.sleep``), for a C function that has no
    frame of its own: the call whose source span is the current instruction's (Python 3.11+),
    else the outermost call on the line (its arguments are evaluated before it runs)."""
    code = frame.f_code
    filename, line = code.co_filename, frame.f_lineno
    text = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(text) if text else None
    except SyntaxError:
        tree = None
    if tree is None:
        return None
    span = None
    positions = getattr(code, "co_positions", None)
    if positions is not None:
        try:
            span = list(positions())[frame.f_lasti // 2]
        except (IndexError, ValueError):
            span = None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if span is not None and None not in span:
        exact = [n for n in calls if (n.lineno, n.end_lineno, n.col_offset, n.end_col_offset) == tuple(span)]
        if exact:
            return ast.unparse(exact[0].func)
    on_line = [n for n in calls if n.lineno == line]
    return ast.unparse(on_line[0].func) if on_line else None  # ast.walk is breadth-first: outermost first


def locate(thread_id: int, user_file: str) -> dict[str, Any]:
    """Describe where thread ``thread_id`` is: its innermost frame of ``user_file`` (file, line,
    function) and the library function it is inside, if any (``library``, its module, the
    library frame's file:line). Empty when the thread is gone."""
    frame = sys._current_frames().get(thread_id)
    stack: list[FrameType] = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if not stack:
        return {}
    innermost = stack[0]
    user = next((f for f in stack if f.f_code.co_filename == user_file), None)
    if user is None:  # e.g. a callable's code: take the innermost frame that is not the engine's
        user = next((f for f in stack if not _is_engine(f.f_code.co_filename)), innermost)
    out: dict[str, Any] = {"file": user.f_code.co_filename, "line": user.f_lineno,
                           "function": "<module>" if user.f_code.co_name == "<module>" else user.f_code.co_name}
    code = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
    if code:
        out["code"] = code
    lib = innermost if innermost is not user else None
    if lib is not None:
        # the outermost library frame under the user's one names the API the user called
        below = stack[:stack.index(user)] if user in stack else stack
        entry = below[-1] if below else lib
        out["library"] = f"{_module_name(entry)}.{entry.f_code.co_name}"
        out["library_at"] = f"{lib.f_code.co_filename}:{lib.f_lineno} in {lib.f_code.co_name}"
    else:
        call = _call_in_progress(user)
        if call:
            out["library"] = call  # a C function: no frame of its own
    return out


def describe(where: dict[str, Any]) -> str:
    """One line for a message: ``train.py:12 in main, inside time.sleep``."""
    if not where:
        return "an unknown place (the program's thread has ended)"
    text = f"{where['file']}:{where['line']} in {where['function']}"
    if where.get("library"):
        text += f", inside {where['library']}"
    return text
