"""Fetching a migrating job's checkpoint at its destination while the source still writes it.

The server picks a migration's destination when the migration is asked for (`moves.migrate`),
long before the checkpoint is in the store, and tells that node's agent at once
(`PrefetchCheckpoint`). The agent's `Prefetcher` follows the checkpoint's files on their way
into the store: the rank files the source streams into ``streams/a<attempt>/ckpt-N/`` and the
files an upload puts into ``ckpt-N/``. Every turn it copies the bytes that have arrived since the
last one (a chunk per file) into a hidden folder of its cache, ``.ckpt-N.prefetch``, hashing them
as they pass. Once ``ckpt-N/manifest.json`` is in the store the checkpoint is complete there; the
prefetcher fetches what is still missing (the tail of each file, the blobs), checks each file
against the manifest's size and digest, fetches again whole any file that does not match (the
source rewrote it, or dropped a streamed copy and uploaded the file whole), and renames the folder
to ``ckpt-N``, where `CheckpointTransfer.download` finds it when the job starts here.

A blob (named by its digest) that a committed checkpoint of this node's cache holds, such as a
fine-tuning job's frozen weights on their way back to a node they left, is hard-linked from there
rather than copied.

Nothing counts because it was prefetched: the manifest decides, as for a plain download, and the
worker verifies every digest again when it reads. A store whose objects appear only once complete
(S3, GCS) still gains: each file is fetched as soon as it appears rather than after the last.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from backend.proxy.checkpoint import digest
from backend.proxy.checkpoint.store import BLOB_DIR, committed_step, lower_this_thread

from .transfer import STREAM_CHUNK, STREAMS, CheckpointTransfer, why_incomplete

log = logging.getLogger("singularity.agent")
#: "0" in the agent's environment turns prefetching off (a store billed per listing, say)
PREFETCH_ENV = "SINGULARITY_STORE_PREFETCH"
#: a prefetch whose job never starts here (it went elsewhere, or its checkpoint failed) ends after this
GIVE_UP_S = 600.0
MANIFEST = "manifest.json"
#: what the background copies between two looks at whether the job is starting (a thread at a
#: lower priority may wait long for its next slice on a busy node: the start must not wait for it)
PIECE = 1 << 20


class _Copy:
    """One file of the checkpoint, copied here as it grows in the store (files there are only
    ever appended to until the manifest names them)."""

    def __init__(self, local: Path, linked: bool = False) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.local = local
        #: a blob linked from a checkpoint of this node's cache: nothing to copy (the install
        #: checks its size against the manifest, the worker its digest)
        self.linked = linked
        self.out = None if linked else open(local, "wb")
        self.got = local.stat().st_size if linked else 0
        self.hash = digest.new()
        #: copied from the committed file from its first byte (after a `restart`): what a download gets
        self.fresh = linked
        #: whole, and matching the manifest (or `fresh`)
        self.checked = linked

    def pull(self, fs: Any, remote: str, size: int, limit: Optional[int],
             stop: Callable[[], bool] = lambda: False) -> int:
        """Copy up to ``limit`` (None: all) of the bytes between what is here and ``size``, a
        piece at a time, until ``stop()`` says to."""
        want = size - self.got if limit is None else min(size - self.got, limit)
        if want <= 0 or self.out is None:
            return 0
        moved = 0
        with fs.open(remote, "rb") as f:
            f.seek(self.got)
            while moved < want and not stop() and (data := f.read(min(PIECE, want - moved))):
                self.out.write(data)
                self.hash.update(data)
                self.got += len(data)
                moved += len(data)
        self.out.flush()  # what was copied is on disk: `got` counts it
        return moved

    def restart(self) -> None:
        """The copy does not match the manifest: copy the committed file again from its start."""
        if self.out is None:  # a linked blob is never rewritten in place: it is another file's bytes
            self.local.unlink(missing_ok=True)
            self.out, self.linked = open(self.local, "wb"), False
        self.out.seek(0)
        self.out.truncate()
        self.got, self.hash, self.fresh = 0, digest.new(), True

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


class Prefetcher:
    """Follows the checkpoints that one attempt of a job writes into the store and copies them
    into this node's cache while they arrive (see the module's docstring).

    Only checkpoints newer than the newest complete one when the prefetch begins are followed:
    those are the migration's (and any periodic one in flight); older ones are fetched, if needed,
    by `CheckpointTransfer.download` as before. The thread runs at a lower priority and ends when
    the job starts here (`finish`) or after `GIVE_UP_S`.
    """

    def __init__(self, transfer: CheckpointTransfer, job_id: str, attempt: int, poll_s: Optional[float] = None,
                 give_up_s: float = GIVE_UP_S) -> None:
        self.t, self.job_id, self.attempt, self.give_up_s = transfer, job_id, attempt, give_up_s
        #: a listing of a filesystem costs little; an object store's is a billed request
        self.poll_s = poll_s if poll_s is not None else (0.02 if "file" in transfer.fs.protocol else 0.25)
        self.local_job = transfer.cache_root / job_id
        self.copies: dict[tuple[int, str], _Copy] = {}
        #: steps installed into the cache, and the bytes copied before their manifest was in the store
        self.installed: dict[int, int] = {}
        #: bytes of the installed steps' blobs linked from the cache rather than copied
        self.linked_bytes = 0
        #: steps of the store's checkpoints when the prefetch began: only newer ones are followed
        self._after = -1
        #: steps whose prefetch failed: the start downloads them as before
        self.failed: set[int] = set()
        self._finishing = threading.Event()
        #: per step being installed: its manifest, and the bytes copied before it was complete
        self._manifests: dict[int, dict[str, Any]] = {}
        self._early: dict[int, int] = {}
        #: held while the copies change: by the thread for a turn (which ends at the next piece once
        #: `finish` has begun), then by `finish`
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Prefetcher":
        self._thread = threading.Thread(target=self._loop, name=f"prefetch-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> dict[int, int]:
        """The job starts here: complete every checkpoint whose manifest is in the store, then stop.
        Returns the steps installed, each with the bytes that were copied before it was complete.

        The rest is fetched on the caller's thread, as soon as the thread has finished the piece it
        is copying: the job waits for it now, so it must not run at the background's priority."""
        self._finishing.set()
        with self._lock:
            try:
                self._apply(self._arriving(), finishing=True)
            except Exception as exc:  # never the start's failure: the download fetches what is missing
                log.warning("prefetching checkpoints of %s: %s; the start downloads them", self.job_id, exc)
            finally:
                self._drop_unfinished()
            return dict(self.installed)

    def stop(self) -> None:
        """Stop at once and drop what is not installed (the agent is shutting down)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        lower_this_thread()
        end = time.monotonic() + self.give_up_s
        try:
            with self._lock:
                self._after = self._newest_complete()
            while not (self._stopping.is_set() or self._finishing.is_set()) and time.monotonic() < end:
                try:
                    arriving = self._arriving()
                    with self._lock:
                        moved = 0 if self._finishing.is_set() else self._apply(arriving, finishing=False)
                except OSError as exc:  # the store hiccuped: try again next turn
                    log.warning("prefetching checkpoints of %s: %s", self.job_id, exc)
                    moved = 0
                if not moved:
                    self._finishing.wait(self.poll_s)
        except Exception:
            log.exception("prefetching checkpoints of %s failed; the start will download them", self.job_id)
        finally:
            with self._lock:
                if not self._finishing.is_set():  # else `finish` has taken what was copied
                    self._drop_unfinished()

    def _newest_complete(self) -> int:
        steps = [committed_step(n) for n in self.t._committed(self.job_id)]
        return max((s for s in steps if s is not None), default=-1)

    def _apply(self, arriving: dict[int, tuple[dict[str, tuple[str, int]], bool]], finishing: bool) -> int:
        """One pass over what is arriving (under the lock): copy a chunk of each file on its way
        into the store; install each checkpoint whose manifest has arrived. Finishing (the job
        starts here): only install those."""
        job = self.t._job(self.job_id)
        moved = 0
        for step, (files, complete) in sorted(arriving.items()):
            if step in self.installed or step in self.failed:
                continue
            if complete:
                try:
                    moved += self._install(job, step, finishing)
                except OSError as exc:
                    if not finishing:  # a file moved or the store hiccuped: the next turn tries again
                        log.info("checkpoint %d of %s: %s; trying again", step, self.job_id, exc)
                        continue
                    log.warning("checkpoint %d of %s could not be prefetched (%s); it is downloaded at the start",
                                step, self.job_id, exc)
                    self.failed.add(step)
                    self._drop(step)
                except (ValueError, KeyError) as exc:
                    log.warning("checkpoint %d of %s could not be prefetched (%s); it is downloaded at the start",
                                step, self.job_id, exc)
                    self.failed.add(step)
                    self._drop(step)
            elif not finishing:
                for rel, (remote, size) in files.items():
                    if self._finishing.is_set():
                        break
                    moved += self._copy(step, rel).pull(self.t.fs, remote, size, STREAM_CHUNK,
                                                        stop=self._finishing.is_set)
        return moved

    def _arriving(self) -> dict[int, tuple[dict[str, tuple[str, int]], bool]]:
        """Per step newer than ``_after``: its files in the store (relative name -> where, size;
        the committed folder's copy over the streamed one) and whether its manifest is there.
        Reads only the store, so it runs outside the lock."""
        job = self.t._job(self.job_id)
        found: dict[int, tuple[dict[str, tuple[str, int]], bool]] = {}
        streams = f"{job}/{STREAMS}/a{self.attempt}"
        for base in (streams, job):
            try:
                listing = self.t.fs.find(base, detail=True)
            except FileNotFoundError:
                continue
            for path, info in listing.items():
                rel = path[len(base):].strip("/")
                head, _, name = rel.partition("/")
                step = committed_step(head)
                if step is None or step <= self._after or not name or name.rpartition("/")[2].startswith("."):
                    continue  # not a checkpoint's, an older one, or a file on its way in (`publish`)
                files, complete = found.get(step, ({}, False))
                if name == MANIFEST:
                    complete = True
                else:
                    files[name] = (path, int(info.get("size") or 0))
                found[step] = (files, complete)
        return found

    def _copy(self, step: int, rel: str) -> _Copy:
        key = (step, rel)
        if key not in self.copies:
            local = self._staging(step) / rel
            linked = False
            if rel.startswith(f"{BLOB_DIR}/"):  # an unchanged blob of a checkpoint this node holds
                local.parent.mkdir(parents=True, exist_ok=True)
                linked = self.t.link_cached_blob(self.local_job, local)
            self.copies[key] = _Copy(local, linked)
        return self.copies[key]

    def _staging(self, step: int) -> Path:
        return self.local_job / f".ckpt-{step:08d}.prefetch"

    def _install(self, job: str, step: int, finishing: bool) -> int:
        """The checkpoint is complete in the store: fetch the rest, check it, put it in the cache.
        In the background a turn copies a chunk of each file and stops when the job starts;
        finishing, it runs to the end."""
        remote = f"{job}/ckpt-{step:08d}"
        final = self.local_job / f"ckpt-{step:08d}"
        early = self._early.setdefault(step, sum(c.got for (s, _), c in self.copies.items() if s == step and not c.linked))
        if (final / MANIFEST).exists():
            self._drop(step)
            self.installed[step] = early
            return 0
        if step not in self._manifests:
            try:
                self._manifests[step] = json.loads(self.t.fs.cat_file(f"{remote}/{MANIFEST}"))
            except json.JSONDecodeError as exc:  # a store that shows a file while it is written
                raise OSError(f"its manifest is not whole yet ({exc})") from exc
        manifest = self._manifests[step]
        wanted: dict[str, tuple[int, Optional[str]]] = {
            # an entry without the current digest (an older engine's) never matches: fetched whole
            n: (int(e["bytes"]), e.get(digest.NAME, "")) for n, e in (manifest.get("files") or {}).items()}
        wanted.update({f"{BLOB_DIR}/{n}": (int(e["bytes"]), None) for n, e in (manifest.get("blobs") or {}).items()})
        for key in [k for k in self.copies if k[0] == step and k[1] not in wanted]:
            copy = self.copies.pop(key)  # not part of the checkpoint after all
            copy.close()
            copy.local.unlink(missing_ok=True)
        limit, stop = (None, lambda: False) if finishing else (STREAM_CHUNK, self._finishing.is_set)
        moved = 0
        for rel, (nbytes, expected) in wanted.items():
            moved += self._settle(step, rel, f"{remote}/{rel}", nbytes, expected, limit, stop)
        if not finishing and not all(self.copies[(step, rel)].checked for rel in wanted):
            return moved  # more next turn, or `finish` completes it
        for rel in wanted:
            self.copies[(step, rel)].close()
        staging = self._staging(step)
        (staging / f"{MANIFEST}.fetch").write_bytes(json.dumps(manifest).encode())
        os.replace(staging / f"{MANIFEST}.fetch", staging / MANIFEST)
        if (why := why_incomplete(staging)) is not None:
            log.warning("checkpoint %d of %s could not be prefetched: %s", step, self.job_id, why)
            self.failed.add(step)
            self._drop(step)
            return moved
        for key in [k for k in self.copies if k[0] == step]:
            if self.copies[key].linked:
                self.linked_bytes += self.copies[key].got
            del self.copies[key]
        os.replace(staging, final)
        self.installed[step] = early
        log.info("prefetched checkpoint %d of %s (%d bytes before it was complete in the store)", step,
                 self.job_id, early)
        return moved

    def _settle(self, step: int, rel: str, remote: str, nbytes: int, expected: Optional[str],
                limit: Optional[int], stop: Callable[[], bool]) -> int:
        """Copy more of one file of a complete checkpoint; mark it checked once it is whole and has
        the manifest's digest. A copy that differs (the source rewrote the file, or dropped a
        streamed copy and uploaded it whole) is copied again from the committed file."""
        copy = self._copy(step, rel)
        moved = 0
        while not copy.checked and not stop():
            got = copy.pull(self.t.fs, remote, nbytes, limit, stop)
            moved += got
            differs = copy.got == nbytes and expected is not None and copy.hash.hexdigest() != expected
            if copy.got > nbytes or (differs and not copy.fresh):
                log.info("prefetched %s of checkpoint %d of %s differs from the committed file; copying it again",
                         rel, step, self.job_id)
                copy.restart()
                continue
            if copy.got == nbytes:
                copy.checked = True  # a fresh copy that differs is the store's damage: the restore refuses it
            elif got == 0 or limit is not None:
                break  # the store's file is short (the install refuses it), or this turn's share is done
        return moved

    def _drop(self, step: int) -> None:
        for key in [k for k in self.copies if k[0] == step]:
            self.copies.pop(key).close()
        shutil.rmtree(self._staging(step), ignore_errors=True)

    def _drop_unfinished(self) -> None:
        for step in {s for s, _ in self.copies}:
            self._drop(step)
