"""A Weights & Biases run (``run = wandb.init(...)``): continued on restore, same id, same step.

A run stands for a service process (wandb-core) and, online, a record on a server; a checkpoint
cannot hold either, and wandb's own pickling (made to hand a run to a child process) attaches to
the writer's service, which ends with the stopped process: the restored job failed at its next
``run.summary`` or ``wandb.log``. So a checkpoint saves what continues the run (`RunSpec`): its
id, project, entity, folder, mode, name, group, job type, tags, notes and config, what the
program set in the summary, the step the next ``log`` gets, and the open row (logged with
``commit=False``, or with ``step=`` until a later step closes it). A restore calls
``wandb.init(id=..., resume="allow", ...)``, which sets ``wandb.run``, ``wandb.log`` and
``wandb.config`` again, and puts the step, the open row and (offline: a new record) the summary
back. Online, the same run goes on; offline, wandb writes a second folder with the same id, which
``wandb sync`` uploads into the same run. The history (steps and values) is the uninterrupted
run's; only ``_runtime`` and ``_timestamp`` differ, as in any resumed run.

A process that stops for a preemption ends without ``atexit``, and wandb-core then dropped what
it had not yet written: `stopped` marks each live run as preempted and finishes it first. Its
open row is held in the process until the call that closes it (`install`), because a finish
writes the open row as a row of its own.

``wandb.config`` and ``run.summary`` held by the program are saved as the run's, and the hooks
of ``wandb.watch(model)`` log through the continued run. A finished run is saved as
`FinishedRun`: its names are kept and logging to it raises as wandb does. A run made with
``mode="disabled"`` is made again disabled.
"""
from __future__ import annotations

import os
import pickle
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from backend.contract import EXIT_PREEMPTED

from . import context, lazy

# what `install`'s wrappers keep in a run's ``__dict__``:
_OPEN_ROW = "_singularity_open_row"  # the open row, not yet sent to wandb-core
_ROOT = "_singularity_root_dir"  # the folder wandb writes under
_SUMMARY = "_singularity_summary"  # what the program set in (or removed from) the summary, by key path
_STEP_DUE = "_singularity_step_due"  # the step wandb-core gets with the next row (an open row's, a restored run's)
#: the runs this process made (`stopped` ends those still live)
_runs: "weakref.WeakSet[Any]" = weakref.WeakSet()


def install() -> None:
    """Keep each run's open row (``log(..., commit=False)``) and folder, once wandb is imported."""
    lazy.when_imported("wandb.sdk.wandb_run", _patch)


def _patch(module: types.ModuleType) -> None:
    run_class = module.Run
    needed = ("_partial_history_callback", "_atexit_cleanup", "_summary_update_callback", "step",
              "mark_preempting")
    if getattr(run_class, "_singularity_patched", False) or not all(hasattr(run_class, n) for n in needed):
        return  # already done, or a wandb older than the one this was written for: `reduce` refuses its runs
    wandb_send = run_class._partial_history_callback
    original_init = run_class.__init__
    original_cleanup = run_class._atexit_cleanup
    original_step = run_class.step
    original_summary = run_class._summary_update_callback

    def send(self: Any, data: dict, step: Optional[int], commit: Optional[bool]) -> None:
        due = self.__dict__.pop(_STEP_DUE, None)
        if due is not None and step is None:  # an open row's step, or a restored run's (none sent yet)
            step, commit = due, commit is not False
        return wandb_send(self, data, step, commit)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        root = getattr(getattr(self, "_settings", None), "root_dir", None) or "."
        self.__dict__[_ROOT] = os.path.abspath(root)  # relative to the folder wandb.init ran in
        _runs.add(self)

    def _partial_history_callback(self: Any, data: dict, step: Optional[int] = None,
                                  commit: Optional[bool] = None) -> None:
        """wandb's, but the open row is held here until the call that closes it (wandb-core
        would write it at the stop's ``finish()``, and the restore's row at that step would
        hold the rest of it); the same rows reach wandb-core at the same steps."""
        row = self.__dict__.setdefault(_OPEN_ROW, {})
        if step is not None and step < self._local_step:
            if _STEP_DUE in self.__dict__:  # wandb-core, new, would take it: dropped as it was
                warnings.warn(f"step {step} < current step {self._local_step}: dropping the row", stacklevel=4)
                return None
            return wandb_send(self, data, step, commit)  # wandb warns and drops it
        if row and step is not None and step > self._local_step:
            send(self, row.copy(), None, True)  # a later step closes the open row at its own step
            row.clear()
        if (step is None and commit is None) or commit:
            merged = {**row, **data}
            row.clear()
            return send(self, merged, step, commit)
        row.update(data)
        if step is not None and step > self._local_step:
            self.__dict__[_STEP_DUE] = step  # wandb-core gets the step with the row, once it is closed
        return None

    def _atexit_cleanup(self: Any, exit_code: Optional[int] = None) -> None:
        row = self.__dict__.get(_OPEN_ROW)
        if row:  # finished with a row open: wandb writes it, so it is sent first
            send(self, dict(row), None, False)
            row.clear()
        return original_cleanup(self, exit_code)

    def _summary_update_callback(self: Any, record: Any) -> None:
        made = self.__dict__.setdefault(_SUMMARY, {})
        made.update({tuple(item.key): (True, item.value) for item in record.update})
        made.update({tuple(item.key): (False, None) for item in record.remove})
        return original_summary(self, record)

    def step(self: Any) -> int:
        due = self.__dict__.get(_STEP_DUE)
        return original_step.fget(self) if due is None else due

    run_class.__init__ = __init__
    run_class._partial_history_callback = _partial_history_callback
    run_class._atexit_cleanup = _atexit_cleanup
    run_class._summary_update_callback = _summary_update_callback
    run_class.step = property(step, doc=original_step.__doc__)
    run_class._singularity_patched = True


def stopped() -> None:
    """The process stops for a preemption (and then ends without its ``atexit`` handlers): each
    live run is marked as preempted and finished, so wandb-core writes (online: sends) what was
    logged before the checkpoint; left to the exit, it was lost, and the restore continues the run."""
    for run in list(_runs):
        if getattr(run, "_is_finished", False):
            continue
        try:
            run.__dict__.pop(_OPEN_ROW, None)  # in the checkpoint: the restore's first rows close it
            run.mark_preempting()
            run.finish(exit_code=EXIT_PREEMPTED)
        except Exception as exc:  # a run that cannot end cleanly must not stop the others, nor the stop
            warnings.warn(f"the W&B run {getattr(run, 'id', '?')} could not be finished before the stop: {exc}",
                          RuntimeWarning, stacklevel=2)


def _is_run(t: type) -> bool:
    return t.__name__ == "Run" and t.__module__ == "wandb.sdk.wandb_run"


def _is_noop_run(t: type) -> bool:
    return t.__name__ == "NoopRun" and t.__module__ == "wandb.sdk.lib.noop_run"


@dataclass
class RunSpec:
    """What continues a run: `wandb.init`'s arguments, plus its step, open row and summary."""

    init: dict[str, Any]
    folder: Optional[tuple[str, bool]]  # `context.relative_path` of the folder wandb writes under
    step: int = 0
    open_row: dict[str, Any] = field(default_factory=dict)
    summary: dict[tuple, tuple[bool, Any]] = field(default_factory=dict)  # (set, value) or (removed, None)


def reduce(obj: Any) -> Any:
    """A reduction for a wandb run, or its config or summary, else NotImplemented."""
    t = type(obj)
    module = t.__module__
    if not module.startswith("wandb."):
        return NotImplemented
    if _is_run(t):
        if not getattr(t, "_singularity_patched", False):
            raise pickle.PicklingError(f"this wandb ({getattr(sys.modules.get('wandb'), '__version__', '?')}) is "
                                       f"older than the W&B runs a checkpoint can continue: install wandb>=0.19")
        if getattr(obj, "_is_finished", False):
            return FinishedRun, (_names(obj), dict(obj.config))
        return _continue_run, (_spec(obj),)
    if _is_noop_run(t):
        return _continue_run, (RunSpec({"mode": "disabled"}, None),)
    if t.__name__ == "TorchHistory" and module == "wandb.integration.torch.wandb_torch":
        owner = next((run for run in _runs if run.__dict__.get("_torch_history") is obj), None)
        return _torch_history, (owner, {k: v for k, v in vars(obj).items() if k != "hook_torch"})
    if t.__name__ == "Config" and module == "wandb.sdk.wandb_config":
        owner = getattr(getattr(obj, "_callback", None), "__self__", None)
        if owner is not None and _is_run(type(owner)):
            return getattr, (owner, "config")
    if t.__name__ == "Summary" and module == "wandb.sdk.wandb_summary":
        owner = getattr(getattr(obj, "_update_callback", None), "__self__", None)
        if owner is not None and _is_run(type(owner)):
            return getattr, (owner, "summary")
    return NotImplemented


def _names(run: Any) -> dict[str, Any]:
    return {"id": run.id, "project": run.project, "entity": run.entity or None, "name": run.name,
            "group": run.group or None, "job_type": run.job_type or None, "tags": list(run.tags or ()),
            "notes": run.notes}


def _spec(run: Any) -> RunSpec:
    init = _names(run)
    init.update(mode=run.settings.mode, config=dict(run.config), resume="allow")
    root = run.__dict__.get(_ROOT)
    return RunSpec(init, context.relative_path(root) if root else None, run._local_step,
                   dict(run.__dict__.get(_OPEN_ROW, {})), dict(run.__dict__.get(_SUMMARY, {})))


def _continue_run(spec: RunSpec) -> Any:
    """``wandb.init`` again for the saved run, at its step, with its open row and summary."""
    import wandb

    init = dict(spec.init)
    if spec.folder is not None:
        init["dir"] = context.resolve_path(*spec.folder)
    run = wandb.init(**init)
    if init.get("mode") == "disabled":
        return run
    if run.settings.mode == "offline" and spec.summary:  # a new record: online, the server kept it
        run._summary_update_callback(_summary_record(spec.summary))
    run.__dict__[_SUMMARY] = dict(spec.summary)
    if run._local_step < spec.step:  # offline (a new record), or online with nothing logged since
        run.__dict__[_STEP_DUE] = spec.step  # an empty row sent now would be written at the end
        run._local_step = spec.step  # what `Run._log` keeps beside wandb-core's step
    elif run._local_step > spec.step:
        warnings.warn(f"the W&B run {run.id} already holds steps up to {run._local_step - 1}, logged after "
                      f"the checkpoint of step {spec.step} was taken (its node was lost); wandb keeps those "
                      f"and drops the values logged again for them", stacklevel=2)
    run.__dict__[_OPEN_ROW] = dict(spec.open_row)
    return run


def _summary_record(made: dict[tuple, tuple[bool, Any]]) -> Any:
    """One record that sets (and removes) what the program did in the summary."""
    from wandb.sdk.interface.summary_record import SummaryItem, SummaryRecord

    record = SummaryRecord()
    for key, (kept, value) in made.items():
        item = SummaryItem()
        item.key = key
        if kept:
            item.value = value
            record.update.append(item)
        else:
            record.remove.append(item)
    return record


def _torch_history(run: Any, state: dict[str, Any]) -> Any:
    """What ``wandb.watch(model)``'s hooks log through: the continued run's, with the hooks' handles.
    (Made by its constructor, which also gives wandb's module its ``torch``, or the hooks fail.)"""
    if run is not None and not isinstance(run, FinishedRun):
        history = run._torch
    else:
        from wandb.integration.torch import wandb_torch

        history = wandb_torch.TorchHistory()
    vars(history).update(state)
    return history


class FinishedRun:
    """A run that had finished when the checkpoint was taken: its names, its config, and the
    error wandb raises when a finished run is used."""

    def __init__(self, names: dict[str, Any], config: dict[str, Any]) -> None:
        self.__dict__.update(names)
        self.config = config

    def finish(self, *args: Any, **kwargs: Any) -> None:
        return None  # as for a finished run

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        errors = sys.modules.get("wandb.errors")
        error = getattr(errors, "UsageError", RuntimeError)
        raise error(f"Run ({self.__dict__.get('id')}) is finished. The call to `{name}` will be ignored. "
                    f"Please make sure that you are using an active run.")

    def __reduce__(self) -> tuple:
        names = {k: v for k, v in self.__dict__.items() if k != "config"}
        return FinishedRun, (names, self.config)
