"""A job's folder as bytes: the synced copy sent with a job, and the files it carries in checkpoints.

When a node does not see the folder a job was submitted from, the job runs in a copy of it
(sent at submit, like a runtime working_dir). The files the job writes there exist on one node
only, so each checkpoint carries the copy's contents and a restore on another node puts them
back: the folder is rolled back to what it held at that checkpoint, exactly like the program.
The SDK packs at submit and the workers unpack and carry, so the format lives here, in a module
that imports nothing else (workers import it without the rest of the SDK).
"""
from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

#: Largest folder (sum of its files' sizes) that travels as a synced copy or in a checkpoint.
MAX_WORKDIR_BYTES = 32 * 1024 * 1024
#: Never copied: caches the interpreter rebuilds, and version control.
SKIPPED = frozenset({"__pycache__", ".git", ".ipynb_checkpoints"})


class WorkdirTooLarge(ValueError):
    """The folder is over the cap; the message names it and what to do."""


def _files(folder: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
        out.extend(Path(root) / n for n in sorted(names))
    return out


def pack(folder: str, limit: int = MAX_WORKDIR_BYTES) -> bytes:
    """The folder as a gzip'd tar (regular files and folders; links are followed)."""
    root = Path(folder)
    files = [p for p in _files(root) if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    if total > limit:
        biggest = max(files, key=lambda p: p.stat().st_size)
        raise WorkdirTooLarge(
            f"the job's folder {root} holds {total / 2**20:.1f} MiB; a synced copy is limited to "
            f"{limit / 2**20:.0f} MiB (largest file: {biggest.relative_to(root)}, "
            f"{biggest.stat().st_size / 2**20:.1f} MiB). Keep data sets and outputs out of the folder "
            f"(read them from storage every node sees), or run on nodes that share the folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for p in sorted(_dirs(root)) + files:  # folders first: empty ones travel too
            tar.add(p, arcname=str(p.relative_to(root)), recursive=False)
    return buf.getvalue()


def _dirs(root: Path) -> set[Path]:
    found = set()
    for here, dirs, _names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        found.update(Path(here) / d for d in dirs)
    return found


def unpack(data: bytes, folder: str, replace: bool = False) -> None:
    """Extract ``data`` into ``folder``; ``replace`` first removes what is there (a rollback)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    if replace:
        for child in root.iterdir():
            if child.name in SKIPPED:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(root, filter="data")  # no absolute paths, no escaping the folder
