"""Moving checkpoints between a node's local cache and a store every node can reach.

Used when nodes share no filesystem: ``--store URL`` (anything fsspec opens: file://, s3://,
gs://, az://, ...). Workers always write and read a local folder; the agent uploads each
committed checkpoint and, before a restore, fetches the newest ones it lacks.

A checkpoint is uploaded file by file with ``manifest.json`` last, so a reader that sees a
manifest sees a complete checkpoint. Writes are fenced: every upload carries the attempt
number, and the store's ``FENCE`` file holds the newest attempt started; an upload from an
older attempt (a node that was presumed lost and came back) is refused instead of mixing an
old timeline into the new one.

A data-parallel job whose ranks sit on several nodes writes each checkpoint in parts: every rank
puts its own file into its node's cache, and a checkpoint commits only where one folder holds all
of them. `PartExchange` brings them together: the agents of the nodes without rank 0 upload their
ranks' finished parts (``parts/a<attempt>/ckpt-N/`` in the job's folder of the store, the part's
``rank-R.json`` last), and the agent of rank 0's node fetches the others' parts into its staging
folder (``rank-R.json`` last again) and commits the set there, exactly as a last local rank would.
Rank 0 then reports the checkpoint and its agent uploads it whole, as for a one-node job.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Optional

import fsspec

from backend.proxy.checkpoint.store import BLOB_DIR, MEETING_FILE, CheckpointStore, committed_step, staging_step

log = logging.getLogger("singularity.agent")
#: the store's folder (in the job's) for the parts of checkpoints that are not complete anywhere yet
PARTS = "parts"


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
            if committed_step(name) is not None and self.fs.exists(f"{self._job(job_id)}/{name}/manifest.json"):
                complete.append(name)
        return complete

    def _prune(self, job_id: str, keep: int) -> None:
        for name in self._committed(job_id)[:-keep]:
            self.fs.rm(f"{self._job(job_id)}/{name}", recursive=True)

    def download(self, job_id: str, keep: int = 2, upto: Optional[int] = None) -> Optional[Path]:
        """Fetch the newest ``keep`` complete checkpoints (of steps up to ``upto``, the one the
        server names) missing from the local cache.

        Returns the job's local checkpoint folder (what the worker restores from). Each one is
        fetched into a hidden staging folder and renamed, so a crash never leaves half of one."""
        local_job = self.cache_root / job_id
        local_job.mkdir(parents=True, exist_ok=True)
        names = [n for n in self._committed(job_id) if upto is None or (committed_step(n) or 0) <= upto]
        for name in names[-keep:]:
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

    def exchange(self, job_id: str, attempt: int, world_size: int, local_ranks: Iterable[int]) -> "PartExchange":
        """The part exchange of one attempt of a job whose ranks are not all on this node."""
        return PartExchange(self, job_id, attempt, world_size, local_ranks)

    def clear(self, job_id: str) -> None:
        if self.fs.exists(self._job(job_id)):
            self.fs.rm(self._job(job_id), recursive=True)


class PartExchange:
    """Moves the parts of one spread attempt's checkpoints between its nodes through the store.

    `step` is one pass (blocking; the agent runs it in a thread): on a node without rank 0 it
    uploads each of this node's parts that is finished (its ``rank-R.json`` is in the staging
    folder) and drops the node's staging folder once every local part of it is up; on rank 0's
    node, for each checkpoint rank 0 has written its part of, it fetches the other ranks' parts
    that are up and commits the set once it is complete. Only parts written since this attempt
    started are looked at, so a crashed attempt's leftovers never join its checkpoints.
    """

    def __init__(self, transfer: CheckpointTransfer, job_id: str, attempt: int, world_size: int,
                 local_ranks: Iterable[int], since: Optional[float] = None):
        self.t = transfer
        self.job_id, self.attempt, self.world_size = job_id, attempt, world_size
        self.local = sorted(set(local_ranks))
        self.gathers = 0 in self.local
        # file times come from the kernel's coarse clock, a tick behind time.time() at most
        self.since = time.time() - 0.01 if since is None else since
        self.local_job = transfer.cache_root / job_id
        self.sent: set[tuple[int, int]] = set()  # (step, rank) uploaded
        self.sent_blobs: dict[int, set[str]] = {}  # step -> blobs uploaded (ranks here share them)
        self.committed: set[int] = set()
        # the parts meet in the store: the same place for this job's ranks on every node
        place = hashlib.sha256(f"{transfer.fs.unstrip_protocol(transfer._job(job_id))}".encode()).hexdigest()
        self.local_job.mkdir(parents=True, exist_ok=True)
        tmp = self.local_job / f"{MEETING_FILE}.agent"
        tmp.write_text(place[:16])
        os.replace(tmp, self.local_job / MEETING_FILE)

    def _remote(self, step: int) -> str:
        return f"{self.t._job(self.job_id)}/{PARTS}/a{self.attempt}/ckpt-{step:08d}"

    def _fresh(self, path: Path) -> bool:
        try:
            return path.stat().st_mtime >= self.since
        except FileNotFoundError:
            return False

    def _staging(self) -> list[tuple[int, Path]]:
        try:
            entries = list(self.local_job.iterdir())
        except FileNotFoundError:
            return []
        return sorted((step, p) for p in entries if (step := staging_step(p.name)) is not None and p.is_dir())

    def step(self) -> None:
        if self.gathers:
            self._gather()
        else:
            self._send()

    # ------------------------------------------------------------------ nodes without rank 0
    def _send(self) -> None:
        for step, staging in self._staging():
            for rank in self.local:
                side = staging / f"rank-{rank}.json"
                if (step, rank) in self.sent or not self._fresh(side):
                    continue
                newest = self.t._fenced(self.job_id)
                if self.attempt < newest:
                    raise StaleAttempt(f"attempt {self.attempt} of {self.job_id} is stale "
                                       f"(attempt {newest} has started)")
                remote = self._remote(step)
                self.t.fs.makedirs(f"{remote}/{BLOB_DIR}", exist_ok=True)
                sent_blobs = self.sent_blobs.setdefault(step, set())
                for blob in json.loads(side.read_text()).get("blobs") or {}:
                    if blob not in sent_blobs:
                        self.t.fs.put_file(str(staging / BLOB_DIR / blob), f"{remote}/{BLOB_DIR}/{blob}")
                        sent_blobs.add(blob)
                self.t.fs.put_file(str(staging / f"rank-{rank}.pt"), f"{remote}/rank-{rank}.pt")
                self.t.fs.put_file(str(side), f"{remote}/rank-{rank}.json")  # last: the part is complete
                self.sent.add((step, rank))
                log.info("sent part %d of checkpoint %d of %s to the store", rank, step, self.job_id)
            if all((step, r) in self.sent for r in self.local):
                # every part of this node is in the store: nothing here will ever commit it
                shutil.rmtree(staging, ignore_errors=True)
                self.sent_blobs.pop(step, None)

    # ------------------------------------------------------------------ rank 0's node
    def _gather(self) -> None:
        for step, staging in self._staging():
            if step in self.committed or not self._fresh(staging / "rank-0.json"):
                continue
            remote = self._remote(step)
            missing = [r for r in range(self.world_size) if not (staging / f"rank-{r}.json").exists()]
            for rank in missing:
                if rank in self.local or not self.t.fs.exists(f"{remote}/rank-{rank}.json"):
                    continue
                self._fetch(remote, staging, rank)
            if all((staging / f"rank-{r}.json").exists() for r in range(self.world_size)):
                final = staging.parent / f"ckpt-{step:08d}"
                CheckpointStore(staging.parent)._try_commit(staging, final, step, self.world_size)
                self.committed.add(step)
                log.info("checkpoint %d of %s committed from the parts of %d ranks", step, self.job_id,
                         self.world_size)
                self._forget_parts(step)

    def _fetch(self, remote: str, staging: Path, rank: int) -> None:
        side = json.loads(self.t.fs.cat_file(f"{remote}/rank-{rank}.json"))
        blob_dir = staging / BLOB_DIR
        for blob, nbytes in (side.get("blobs") or {}).items():
            target = blob_dir / blob
            if target.exists() and target.stat().st_size == int(nbytes):
                continue  # the same bytes, written here by a local rank
            blob_dir.mkdir(exist_ok=True)
            self._get(f"{remote}/{BLOB_DIR}/{blob}", target)
        self._get(f"{remote}/rank-{rank}.pt", staging / f"rank-{rank}.pt")
        tmp = staging / f"rank-{rank}.json.fetch"
        tmp.write_text(json.dumps(side))
        os.replace(tmp, staging / f"rank-{rank}.json")  # last: the part is in
        log.info("fetched part %d of checkpoint %s of %s", rank, staging.name, self.job_id)

    def _get(self, remote: str, target: Path) -> None:
        tmp = target.with_name(f".{target.name}.fetch")
        self.t.fs.get_file(remote, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def _forget_parts(self, upto: int) -> None:
        """Parts of checkpoints up to ``upto`` are in a committed one now; so are older attempts'."""
        base = f"{self.t._job(self.job_id)}/{PARTS}"
        try:
            attempts = self.t.fs.ls(base, detail=False)
        except FileNotFoundError:
            return
        for entry in attempts:
            name = os.path.basename(entry.rstrip("/"))
            if name != f"a{self.attempt}":
                if name.startswith("a") and name[1:].isdigit() and int(name[1:]) < self.attempt:
                    self.t.fs.rm(entry, recursive=True)
                continue
            for ck in self.t.fs.ls(entry, detail=False):
                step = committed_step(os.path.basename(ck.rstrip("/")))
                if step is not None and step <= upto:
                    self.t.fs.rm(ck, recursive=True)

    async def run(self, done: asyncio.Event, poll_s: float = 0.1) -> None:
        """Pass after pass until the attempt's ranks here have exited, and once more after (a rank
        that stops after a checkpoint exits as soon as its part is written)."""
        while True:
            finished = done.is_set()
            try:
                await asyncio.to_thread(self.step)
            except StaleAttempt as exc:
                log.warning("%s: its checkpoint parts stay out of the store", exc)
                return
            except Exception:
                log.exception("moving checkpoint parts of %s through the store failed; retrying", self.job_id)
            if finished:
                return
            try:
                await asyncio.wait_for(done.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
