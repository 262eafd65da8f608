"""Where a job runs: the folder it was submitted from, or this node's synced copy of it.

``python script.py ARGS`` run from a folder sees that folder as its working directory, the
script's folder first on ``sys.path`` and ``sys.argv == [script, *ARGS]``; a job gets the same.
A node that sees the folder (a local cluster, a shared filesystem) runs the job in it, so the
files it writes are where its user looks. A node that does not (or whose agent environment has
``SINGULARITY_SHARED_WORKDIRS=0``) runs it in a copy sent with the job, kept under the agent's
home for the job's life on that node; that copy's files then travel in every checkpoint.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import sys
from pathlib import Path
from typing import Optional

from backend.contract import ENV_WORKDIR_ROOT, WorkerSpec

#: "0": this node never uses submitters' folders directly, even where the same path exists
SHARED_ENV = "SINGULARITY_SHARED_WORKDIRS"


def enter(spec: WorkerSpec) -> str:
    """Set argv, cwd and ``sys.path[0]`` for the job; returns the file name its code runs under
    (the script's absolute path when it is a file). Without a folder (an older client) the job
    stays in its per-attempt folder. Raises FileNotFoundError saying what to do."""
    filename = spec.filename
    sys.argv = [filename, *spec.args]
    workdir = spec.workdir
    if not workdir:
        return filename
    folder = workdir if _sees(workdir, spec) else _synced_copy(spec)
    if folder is None:
        raise FileNotFoundError(
            f"the job's folder {workdir} (where it was submitted from) is not visible on this node, and the job "
            f"carries no copy of it; run it on nodes that share that folder, or submit with --sync-workdir "
            f"(sync_workdir=True) to send a copy")
    os.chdir(folder)
    script = filename if filename.startswith("<") else os.path.join(folder, filename)
    sys.path[0] = folder if script.startswith("<") else os.path.dirname(script)
    return script


def _sees(workdir: str, spec: WorkerSpec) -> bool:
    """The node sees the submitter's folder: it exists, and when a copy came along, holds the
    same script (another machine may have an unrelated folder at the same path)."""
    if not os.path.isdir(workdir):
        return False
    if not spec.workdir_b64:
        return True
    if os.environ.get(SHARED_ENV, "1") == "0":
        return False
    filename = spec.filename
    if filename.startswith("<") or spec.source is None:
        return True
    try:
        here = Path(workdir, filename).read_bytes()
    except OSError:
        return False
    return hashlib.sha256(here).digest() == hashlib.sha256(spec.source.encode("utf-8", "surrogatepass")).digest()


def _synced_copy(spec: WorkerSpec) -> Optional[str]:
    """This node's copy of the folder, unpacked once per job (ranks on the node share it)."""
    data = spec.workdir_b64
    root = os.environ.get(ENV_WORKDIR_ROOT)
    if not data or not root:
        return None
    from backend.proxy.engine import context
    from singularity_sdk import folders

    folder = Path(root, spec.job_id)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder.with_suffix(".attempt")
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first rank of this attempt on the node unpacks
        done = marker.read_text() if marker.exists() else ""
        if done != str(spec.attempt):
            if not spec.restore or not done:
                # A fresh start begins from the submitted folder; a restore from the checkpoint's
                # files, which rank 0 puts back (a folder that never held the job needs a base).
                folders.unpack(base64.b64decode(data), str(folder), replace=True)
            marker.write_text(str(spec.attempt))
    if os.environ.get("RANK", "0") == "0":
        context.carry_files(str(folder))  # the files it writes here exist on this node only
    return str(folder)
