"""What mlflow's fluent API holds for the job: its active runs, experiment and tracking URI.

``with mlflow.start_run():`` around the loop and ``mlflow.log_metric(...)`` inside it log to a
run that mlflow keeps in its own module (a stack of active runs per thread, the experiment of
``set_experiment``, the URI of ``set_tracking_uri``), where no checkpoint looked. A restored job
found no active run, and ``log_metric`` quietly started a new one: the metrics after the restore
went to another run under a made-up name, and the first stayed "running" for ever. A checkpoint
now carries that state (the job thread's active runs as the very objects the program holds, so
``run.info.run_id`` and the ``with`` statement's exit agree) and a restore puts it back: the
calls go on logging to the same run. The run itself lives in the tracking store (a server, a
database, or files in the job's folder, which the job carries), and a stop leaves it as it is,
running, as a preempted job is. Asynchronous logging is flushed before a process stops.

``with mlflow.start_run() as run:`` around the loop is held across stops (held_managers.py): the
stop does not end the run, and its ``__exit__`` ends it once, at the real end of the block. A
restore evaluates the header of such a with statement again, where ``start_run`` would start a
new run (or fail: the saved one is active again); while a restore re-enters the program,
``start_run`` returns the active run instead, which the saved manager then replaces (`install`).
"""
from __future__ import annotations

import functools
import sys
import types
import warnings
from typing import Any, Optional

from . import lazy, libraries

_FLUENT = "mlflow.tracking.fluent"


def install() -> None:
    """``start_run`` re-evaluated by a restore starts nothing (once mlflow is imported)."""
    lazy.when_imported(_FLUENT, _patch)


def _patch(fluent: types.ModuleType) -> None:
    start_run = fluent.start_run
    if getattr(start_run, "_singularity_patched", False):
        return

    @functools.wraps(start_run)
    def patched(*args: Any, **kwargs: Any) -> Any:
        runtime = libraries.REGISTRY.runtime
        stack = _get(fluent._active_run_stack)
        if runtime is not None and runtime.restoring and stack:
            return stack[-1]  # a with statement's header again: the saved manager takes its place
        return start_run(*args, **kwargs)

    patched._singularity_patched = True  # type: ignore[attr-defined]
    fluent.start_run = patched
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and getattr(mlflow, "start_run", None) is start_run:
        mlflow.start_run = patched  # already bound by ``mlflow/__init__``: it imports fluent first


def is_active_run(manager: Any) -> bool:
    """An ``mlflow.ActiveRun``: what ``with mlflow.start_run():`` holds across stops."""
    t = type(manager)
    return t.__name__ == "ActiveRun" and t.__module__ == _FLUENT


def capture() -> Optional[dict[str, Any]]:
    """mlflow's fluent state for the job's thread; None where mlflow was not used (not imported,
    or imported by a library and left alone)."""
    fluent = sys.modules.get(_FLUENT)
    if fluent is None:
        return None
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = sys.modules.get("mlflow.tracking._model_registry.utils")
    state = {"runs": list(_get(fluent._active_run_stack) or ()),
             "last_run_id": _get(getattr(fluent, "_last_active_run_id", None)),
             "experiment_id": getattr(fluent, "_active_experiment_id", None),
             "tracking_uri": getattr(tracking, "_tracking_uri", None),
             "registry_uri": getattr(registry, "_registry_uri", None)}
    return state if any(v for v in state.values()) else None


def apply(saved: Optional[dict[str, Any]]) -> None:
    """Put the saved state back (before the program goes on): the same runs active, in order."""
    if saved is None:
        return
    import mlflow.tracking.fluent as fluent
    from mlflow.tracking._model_registry import utils as registry
    from mlflow.tracking._tracking_service import utils as tracking

    tracking._tracking_uri = saved["tracking_uri"]
    registry._registry_uri = saved["registry_uri"]
    fluent._active_experiment_id = saved["experiment_id"]
    _set(fluent, "_active_run_stack", list(saved["runs"]))
    if hasattr(fluent, "_last_active_run_id"):
        _set(fluent, "_last_active_run_id", saved["last_run_id"])


def stopped() -> None:
    """The process stops for a preemption: what mlflow queued to log asynchronously for the job's
    active runs is sent first (without one, nothing: asking for the store would make one, e.g. an
    ``mlflow.db`` in the job's folder, where a library merely imported mlflow)."""
    fluent = sys.modules.get(_FLUENT)
    flush = getattr(fluent, "flush_async_logging", None)
    if flush is None or not _get(fluent._active_run_stack):
        return
    try:
        flush()
    except Exception as exc:  # the checkpoint is written: the stop goes on, saying what was not sent
        warnings.warn(f"mlflow's queued metrics could not be sent before the stop: {exc}", RuntimeWarning,
                      stacklevel=2)


def _get(variable: Any) -> Any:
    """A ``ThreadLocalVariable``'s value for this thread (mlflow >= 2.10), or the plain value."""
    return variable.get() if hasattr(variable, "get") and hasattr(variable, "set") else variable


def _set(fluent: Any, name: str, value: Any) -> None:
    variable = getattr(fluent, name)
    if hasattr(variable, "get") and hasattr(variable, "set"):
        variable.set(value)
    else:
        setattr(fluent, name, value)
