"""The process context of a job: argv, working directory and the environment changes it made.

A resumed job runs in a new process, which starts with the service's environment and in the
job's folder. What the job itself changed since it began (``os.chdir()``, ``os.environ[...] =``,
``sys.argv`` edits) lives only in the old process, so it is captured with every checkpoint and
redone before the restored code continues. The working directory is stored relative to the
job's folder when it lies inside it, so it still resolves when the folder is a synced copy at
another path on another node. When the job runs in such a copy, the copy's files travel in the
checkpoint too (`carried_folder`), and a restore rolls the copy back to them as the checkpoint is
read, before the files the program held open are opened again (open_files.py).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

from singularity_sdk import folders
from ..checkpoint.errors import CheckpointError, CheckpointFailure

#: Variables the service sets for each attempt (placement, devices, rendezvous): a restored job
#: gets the new attempt's values even if it had overwritten them.
SERVICE_KEYS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS"})

_start: dict[str, Any] = {}
#: the synced copy whose files travel in this process's checkpoints (None: a folder nodes share)
_carried: dict[str, Optional[str]] = {"folder": None}


def carry_files(folder: Optional[str]) -> None:
    """Put the contents of ``folder`` (the job's synced copy) in every checkpoint from now on."""
    _carried["folder"] = folder


def begin() -> None:
    """Remember the context the program starts from: what later captures are relative to."""
    _start.clear()
    _start.update(cwd=os.getcwd(), env=dict(os.environ), pid=os.getpid())


def _baseline() -> dict[str, Any]:
    if _start.get("pid") != os.getpid():  # a forked child, or begin() was never called
        begin()
    return _start


def _ours(key: str) -> bool:
    return key in SERVICE_KEYS or key.startswith("SINGULARITY_")


def job_folder() -> str:
    """The folder the job started in: its own files, and the modules beside its script."""
    return _baseline()["cwd"]


def relative_path(path: str) -> tuple[str, bool]:
    """``path`` relative to the job's starting folder when inside it (then True), else as given:
    what still resolves when the folder is a synced copy at another path on another node."""
    rel = os.path.relpath(path, _baseline()["cwd"])
    inside = rel == "." or not (rel == os.pardir or rel.startswith(os.pardir + os.sep))
    return (rel, True) if inside else (path, False)


def resolve_path(path: str, relative: bool) -> str:
    """The absolute path of what `relative_path` returned, in this process's job folder."""
    return os.path.normpath(os.path.join(_baseline()["cwd"], path)) if relative else path


def capture() -> dict[str, Any]:
    """argv, cwd (relative to the starting folder when inside it) and the job's env changes."""
    base = _baseline()
    env, start_env = os.environ, base["env"]
    cwd, inside = relative_path(os.getcwd())
    return {
        "argv": list(sys.argv),
        "cwd": cwd,
        "cwd_relative": inside,
        "set": {k: v for k, v in env.items() if start_env.get(k) != v and not _ours(k)},
        "unset": sorted(k for k in start_env if k not in env and not _ours(k)),
    }


class _OnLoad:
    """A step of the restore put in a checkpoint graph: unpickling it runs ``fn(*args)`` at once,
    before the parts of the graph that come after it are read."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def carried_folder() -> Optional[_OnLoad]:
    """The synced copy's files, for a checkpoint graph (None when the job's folder is shared).
    Put before anything that may hold an open file: loading it rolls the copy back first."""
    folder = _carried["folder"]
    if folder is None:
        return None
    try:
        return _OnLoad(roll_back_folder, folders.pack(folder))
    except (folders.WorkdirTooLarge, OSError) as exc:
        raise CheckpointFailure(f"the job's files cannot travel with the checkpoint: {exc}") from exc


def import_path() -> _OnLoad:
    """``sys.path`` (entries inside the job's folder relative to it), for a checkpoint graph:
    a script that did ``sys.path.insert(0, "src")`` before its loop still imports from ``src``;
    loading it puts them back before the classes of the modules they lead to are looked up."""
    return _OnLoad(restore_import_path, [relative_path(p) if p else (p, False) for p in sys.path if isinstance(p, str)])


def restore_import_path(entries: list[tuple[str, bool]]) -> None:
    """The checkpoint's ``sys.path`` first, in its order, then this process's other entries."""
    saved = [resolve_path(p, relative) if p else p for p, relative in entries]
    sys.path[:] = saved + [p for p in sys.path if p not in saved]


def roll_back_folder(data: bytes) -> None:
    """Put the synced copy back to what it held at the checkpoint, like the program itself."""
    if _carried["folder"] is not None:
        folders.unpack(data, _carried["folder"], replace=True)


def restore(context: Optional[dict[str, Any]]) -> None:
    """Redo a captured context in this process (a checkpoint without one changes nothing)."""
    if not context:
        return
    if context.get("files") is not None:  # a checkpoint from before `carried_folder`
        roll_back_folder(context["files"])
    target = resolve_path(context["cwd"], context["cwd_relative"])
    if not os.path.isdir(target):
        where = f"{context['cwd']!r} inside the job's folder" if context["cwd_relative"] else repr(target)
        raise CheckpointError(f"the job had changed into the directory {where}, which does not exist on this "
                              f"node; create it (or run the job where its folder is visible) and resume again")
    for key in context["unset"]:
        os.environ.pop(key, None)
    os.environ.update(context["set"])
    sys.argv[:] = context["argv"]
    os.chdir(target)
