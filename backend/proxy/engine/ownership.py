"""Which functions are the program's own, while it runs: those whose state the engine keeps.

A cache decorator (caches.py) or an ``atexit`` handler (exit_handlers.py) on one of the
program's functions belongs to the job, so it is saved with the checkpoint; on a library's
function it is the library's business and stays as it is. The program's own functions are those
of the run's globals (the script's or a cell's) and of the modules in the job's folder.
"""
from __future__ import annotations

import functools
import os
import types
from typing import Any, Optional, Sequence


def in_job_folder(path: str, folders: Sequence[str]) -> bool:
    """Whether the file at real ``path`` is the job's own: inside one of ``folders`` (real paths),
    and not under a hidden folder, ``site-packages``/``dist-packages`` (a virtualenv in the
    folder) or ``__pycache__``."""
    for folder in folders:
        rel = os.path.relpath(path, folder)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            continue
        return not any(p.startswith(".") or p in ("site-packages", "dist-packages", "__pycache__")
                       for p in rel.split(os.sep)[:-1])
    return False


class _Owner:
    def __init__(self) -> None:
        self.globals: Optional[dict] = None
        self.folder: Optional[str] = None

    def set(self, program_globals: Optional[dict], folder: Optional[str]) -> None:
        """From now on (None: no program runs) the program's functions are those of these globals and folder."""
        self.globals, self.folder = program_globals, (os.path.realpath(folder) if folder else None)

    def __call__(self, fn: Any) -> bool:
        """Whether ``fn`` is the program's: a function, or a method or ``functools.partial`` of one."""
        while isinstance(fn, (types.MethodType, functools.partial)):
            fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
        if not isinstance(fn, types.FunctionType):
            return False
        return self.owns(fn.__code__, fn.__globals__)

    def owns(self, code: types.CodeType, code_globals: dict) -> bool:
        """Whether code running with these globals (a function's, a generator frame's) is the program's."""
        if self.globals is None:
            return False
        if code_globals is self.globals:
            return True
        return self.folder is not None and in_job_folder(os.path.realpath(code.co_filename), [self.folder])


#: set by the program for the length of its run
PROGRAM = _Owner()
