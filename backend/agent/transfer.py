"""Moving checkpoints between a node's local cache and a store every node can reach.

Used when nodes share no filesystem: ``--store URL`` (anything fsspec opens: file://, s3://,
gs://, az://, ...). Workers always write and read a local folder; the agent uploads each
committed checkpoint and, before a restore, fetches the newest ones it lacks.

A checkpoint is uploaded file by file with ``manifest.json`` last, so a reader that sees a
manifest sees a complete checkpoint. Writes are fenced: every upload carries the attempt
number, and the store's ``FENCE`` file holds the newest attempt started; an upload from an
older attempt (a node that was presumed lost and came back) is refused instead of mixing an
old timeline into the new one.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import fsspec

_COMMITTED = re.compile(r"^ckpt-(\d{8,})$")


class StaleAttempt(Exception):
    """This attempt has been superseded; its checkpoints must not reach the store."""


class CheckpointTransfer:
    def __init__(self, store_url: str, cache_root: Path):
        self.fs, root = fsspec.core.url_to_fs(store_url)
        self.root = root.rstrip("/")
        self.cache_root = Path(cache_root)

    def _job(self, job_id: str) -> str:
        return f"{self.root}/{job_id}"

    def fence(self, job_id: str, attempt: int) -> None:
        """Record ``attempt`` as the newest one of ``job_id`` (never lowers it)."""
        self.fs.makedirs(self._job(job_id), exist_ok=True)
        if attempt > self._fenced(job_id):
            with self.fs.open(f"{self._job(job_id)}/FENCE", "w") as f:
                f.write(str(attempt))

    def _fenced(self, job_id: str) -> int:
        try:
            with self.fs.open(f"{self._job(job_id)}/FENCE", "r") as f:
                return int(f.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def upload(self, job_id: str, attempt: int, local: Path) -> str:
        """Copy one committed checkpoint folder to the store; returns its remote path."""
        newest = self._fenced(job_id)
        if attempt < newest:
            raise StaleAttempt(f"attempt {attempt} of {job_id} is stale (attempt {newest} has started)")
        remote = f"{self._job(job_id)}/{local.name}"
        self.fs.makedirs(remote, exist_ok=True)
        files = sorted(p for p in local.iterdir() if p.is_file() and p.name != "manifest.json")
        for f in files:
            self.fs.put_file(str(f), f"{remote}/{f.name}")
        self.fs.put_file(str(local / "manifest.json"), f"{remote}/manifest.json")  # last: marks it complete
        self._prune(job_id, keep=2)
        return remote

    def _committed(self, job_id: str) -> list[str]:
        try:
            entries = self.fs.ls(self._job(job_id), detail=False)
        except FileNotFoundError:
            return []
        names = sorted(os.path.basename(e.rstrip("/")) for e in entries)
        complete = []
        for name in names:
            if _COMMITTED.match(name) and self.fs.exists(f"{self._job(job_id)}/{name}/manifest.json"):
                complete.append(name)
        return complete

    def _prune(self, job_id: str, keep: int) -> None:
        for name in self._committed(job_id)[:-keep]:
            self.fs.rm(f"{self._job(job_id)}/{name}", recursive=True)

    def download(self, job_id: str, keep: int = 2) -> Optional[Path]:
        """Fetch the newest ``keep`` complete checkpoints missing from the local cache.

        Returns the job's local checkpoint folder (what the worker restores from). Each one is
        fetched into a hidden staging folder and renamed, so a crash never leaves half of one."""
        local_job = self.cache_root / job_id
        local_job.mkdir(parents=True, exist_ok=True)
        for name in self._committed(job_id)[-keep:]:
            target = local_job / name
            if (target / "manifest.json").exists():
                continue
            staging = local_job / f".{name}.download"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            remote = f"{self._job(job_id)}/{name}"
            for entry in self.fs.ls(remote, detail=False):
                base = os.path.basename(entry.rstrip("/"))
                self.fs.get_file(entry, str(staging / base))
            os.replace(staging, target)
        return local_job

    def clear(self, job_id: str) -> None:
        if self.fs.exists(self._job(job_id)):
            self.fs.rm(self._job(job_id), recursive=True)
