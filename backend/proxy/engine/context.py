"""The process context of a job: argv, working directory and the environment changes it made.

A resumed job runs in a new process, which starts with the service's environment and in the
job's folder. What the job itself changed since it began (``os.chdir()``, ``os.environ[...] =``,
``sys.argv`` edits) lives only in the old process, so it is captured with every checkpoint and
redone before the restored code continues. The working directory is stored relative to the
job's folder when it lies inside it, so it still resolves when the folder is a synced copy at
another path on another node. When the job runs in such a copy, the copy's files travel in the
checkpoint too (`files`), and a restore rolls the copy back to them.
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


def capture() -> dict[str, Any]:
    """argv, cwd (relative to the starting folder when inside it) and the job's env changes."""
    base = _baseline()
    env, start_env = os.environ, base["env"]
    cwd = os.getcwd()
    rel = os.path.relpath(cwd, base["cwd"])
    inside = rel == "." or not (rel == os.pardir or rel.startswith(os.pardir + os.sep))
    return {
        "argv": list(sys.argv),
        "cwd": rel if inside else cwd,
        "cwd_relative": inside,
        "set": {k: v for k, v in env.items() if start_env.get(k) != v and not _ours(k)},
        "unset": sorted(k for k in start_env if k not in env and not _ours(k)),
        "files": _pack_carried(),
    }


def _pack_carried() -> Optional[bytes]:
    folder = _carried["folder"]
    if folder is None:
        return None
    try:
        return folders.pack(folder)
    except (folders.WorkdirTooLarge, OSError) as exc:
        raise CheckpointFailure(f"the job's files cannot travel with the checkpoint: {exc}") from exc


def restore(context: Optional[dict[str, Any]]) -> None:
    """Redo a captured context in this process (a checkpoint without one changes nothing)."""
    if not context:
        return
    base = _baseline()
    if context.get("files") is not None and _carried["folder"] is not None:
        # The copy goes back to what it held at the checkpoint, like the program itself.
        folders.unpack(context["files"], _carried["folder"], replace=True)
    target = os.path.join(base["cwd"], context["cwd"]) if context["cwd_relative"] else context["cwd"]
    if not os.path.isdir(target):
        where = f"{context['cwd']!r} inside the job's folder" if context["cwd_relative"] else repr(target)
        raise CheckpointError(f"the job had changed into the directory {where}, which does not exist on this "
                              f"node; create it (or run the job where its folder is visible) and resume again")
    for key in context["unset"]:
        os.environ.pop(key, None)
    os.environ.update(context["set"])
    sys.argv[:] = context["argv"]
    os.chdir(target)
