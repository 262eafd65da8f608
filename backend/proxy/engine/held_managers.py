"""A context manager of the job's own around safe points: held across a stop, not re-entered.

``with Timer("fit") as t:`` around the training loop, ``Timer`` a class of the script or of a
module in the job's folder: a restore runs the with statement's header again, so its
``__enter__`` would run a second time (and the stop's unwinding would have run its ``__exit__``):
what they print or count happens twice where an uninterrupted run does each once. So the
runtime wraps such a manager as it is made (`HeldManager`): a stop skips its ``__exit__`` (the
block is not over), the checkpoint saves the manager and what its ``__enter__`` returned, and a
restore continues the with statement with them, without entering it again; its ``__exit__`` runs
once, when the block really ends. The header expression is still evaluated at restore (its
result is dropped). A ``@contextmanager`` function of the job is held too when its generator is
one generator_rewrite.py rewrote (saved where it waits at its ``yield``, resumed by the
``__exit__`` at the real end of the block); one it could not rewrite is refused (state.py).

A ``contextlib.ExitStack`` is held the same way (``with ExitStack() as stack:`` then
``log = stack.enter_context(open(...))`` in the block): entered again, it would be empty, and
what the block pushed on it would never be closed or called. The saved stack keeps its callbacks,
bound to the restored objects (the file ``log`` names is the one it closes at the end). So is
the run of ``with mlflow.start_run():`` (mlflow_runs.py): a stop does not end it; and a
``tempfile.TemporaryDirectory`` (its exit would remove the folder and what the loop wrote
there), saved with its files and made again at its path (open_files.py).
"""
from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Optional

from . import generator_rewrite, mlflow_runs, ownership


def is_held(manager: Any) -> bool:
    """Whether a with statement holds ``manager`` across stops: an ``ExitStack``, an mlflow run, a
    ``TemporaryDirectory``, a manager whose ``__enter__`` or ``__exit__`` is the program's code, or a
    ``@contextmanager`` of the program whose generator a checkpoint saves where it waits
    (generator_rewrite.py)."""
    if isinstance(manager, (contextlib.ExitStack, tempfile.TemporaryDirectory)) \
            or mlflow_runs.is_active_run(manager):
        return True
    if isinstance(manager, contextlib._GeneratorContextManager):
        gen = getattr(manager, "gen", None)
        frame = getattr(gen, "gi_frame", None)
        return frame is not None and generator_rewrite.STATE in gen.gi_code.co_varnames \
            and ownership.PROGRAM.owns(gen.gi_code, frame.f_globals)
    cls = type(manager)
    return ownership.PROGRAM(getattr(cls, "__enter__", None)) or ownership.PROGRAM(getattr(cls, "__exit__", None))


class HeldManager:
    """Stands for a job's own context manager in its with statement (see the module docstring)."""

    __slots__ = ("manager", "value", "runtime", "entered")

    def __init__(self, manager: Any, runtime: Any, value: Any = None, entered: bool = False) -> None:
        self.manager = manager
        self.value = value  # what the manager's __enter__ returned: the `as` target
        self.runtime = runtime
        self.entered = entered

    def __enter__(self) -> Any:
        if not self.entered:  # a restored one was entered before the stop
            self.value = self.manager.__enter__()
            self.entered = True
        return self.value

    def __exit__(self, et: Any, ev: Any, tb: Any) -> Optional[bool]:
        if self.runtime is not None and self.runtime.preempting:
            return False  # a stop, not the end of the block: the restore goes on inside it
        return self.manager.__exit__(et, ev, tb)

    def __reduce__(self) -> tuple:
        return _held, (self.manager, self.value)


def _held(manager: Any, value: Any) -> HeldManager:
    """A manager restored from a checkpoint: entered already; the runtime sets ``runtime``."""
    return HeldManager(manager, None, value, entered=True)
