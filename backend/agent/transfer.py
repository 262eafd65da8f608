"""Moving checkpoints between a node's local cache and a store every node can reach.

Used when nodes share no filesystem: ``--store URL`` (anything fsspec opens: file://, s3://,
gs://, az://, ...). Workers always write and read a local folder; the agent uploads each
committed checkpoint and, before a restore, fetches the newest ones it lacks.

A checkpoint is uploaded file by file with ``manifest.json`` last, so a reader that sees a
manifest sees a complete checkpoint. Writes are fenced: every upload carries the attempt
number, and the store's ``FENCE`` file holds the newest attempt started; an upload from an
older attempt (a node that was presumed lost and came back) is refused instead of mixing an
old timeline into the new one.

The upload can overlap the write (``SINGULARITY_STORE_STREAM=1`` in the agent's environment;
off by default until a store on another device than the cache shows a gain: see STREAM_ENV).
While an attempt runs, a `Streamer` follows its staging folders
and copies each rank file to ``streams/a<attempt>/ckpt-N/`` in the job's folder of the store as
the worker writes it, hashing the bytes it sends. When the checkpoint commits, `upload` takes
each streamed copy whose size, digest and file (inode) match the manifest, sends the few bytes
still missing, moves it into ``ckpt-N/`` (a rename on a filesystem), uploads whatever was not
streamed the old way, and puts the manifest last as before. A copy that does not match is
dropped and the file is uploaded whole: the streamed bytes never reach a place a reader looks at
unless they are exactly the committed ones. The stream folder is private to the attempt, so a
fenced-off attempt that still streams cannot touch the checkpoints of the attempt after it.

A data-parallel job whose ranks sit on several nodes writes each checkpoint in parts: every rank
puts its own file into its node's cache, and a checkpoint commits only where one folder holds all
of them. `PartExchange` brings them together: the agents of the nodes without rank 0 upload their
ranks' finished parts (``parts/a<attempt>/ckpt-N/`` in the job's folder of the store, the part's
``rank-R.json`` last), and the agent of rank 0's node fetches the others' parts into its staging
folder (``rank-R.json`` last again) and commits the set there, exactly as a last local rank would.
Rank 0 then reports the checkpoint and its agent uploads it whole, as for a one-node job.

Blobs are named by the digest of their bytes, and a fine-tuning job's frozen weights stay the same
blob from one checkpoint to the next. So an upload copies a blob that a committed checkpoint of
the job in the store already holds *within the store* (a hard link on a filesystem store, a
server-side copy on an object store) instead of sending it again, and a download or a prefetch
links a blob that a committed checkpoint of this node's cache holds instead of fetching it. A
blob is taken from elsewhere only under its digest's name and with the manifest's size; the
worker hashes it again when it reads it, as every blob. ``reuse_blobs=False`` turns this off.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

import fsspec

from backend.proxy.checkpoint import digest
from backend.proxy.checkpoint.store import (BLOB_DIR, MEETING_FILE, CheckpointStore, committed_step, lower_this_thread,
                                            staging_step)

log = logging.getLogger("singularity.agent")
#: the store's folder (in the job's) for the parts of checkpoints that are not complete anywhere yet
PARTS = "parts"
#: the store's folder (in the job's) where rank files arrive while their worker writes them
STREAMS = "streams"
#: most bytes a stream moves in one turn, so that the files written side by side all progress
STREAM_CHUNK = 8 << 20
#: "1" turns streaming on. Off by default: measured here (docs/benchmarks.md, migration) with the
#: store on the cache's own disk and 2 busy cores, the write slowed by as much as the upload saved
STREAM_ENV = "SINGULARITY_STORE_STREAM"
#: a rank file of a staging folder, while it is written (``.part``) and once it is complete
_RANK_FILE = re.compile(r"^(rank-\d+\.pt)(\.part)?$")


class StaleAttempt(Exception):
    """This attempt has been superseded; its checkpoints must not reach the store."""


class Uploaded(NamedTuple):
    """Where a checkpoint went in the store, the bytes sent there, and the bytes of its blobs that
    were copied within the store from an earlier checkpoint instead."""
    path: str
    sent_bytes: int
    reused_bytes: int


class CheckpointTransfer:
    def __init__(self, store_url: str, cache_root: Path, reuse_blobs: bool = True):
        self.fs, root = fsspec.core.url_to_fs(store_url)
        self.root = root.rstrip("/")
        self.cache_root = Path(cache_root)
        #: copy blobs an earlier checkpoint holds within the store / link them in the cache (see above)
        self.reuse_blobs = reuse_blobs
        #: job -> the streamer of its attempt running here (`stream`)
        self._streamers: dict[str, Streamer] = {}

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

    def stream(self, job_id: str, attempt: int) -> "Streamer":
        """The streamer of ``attempt`` of ``job_id`` on this node (started by its ``run``): the
        rank files its workers write go to the store while they are written, so that `upload`
        has little left to send once a checkpoint commits."""
        streamer = Streamer(self, job_id, attempt)
        self._streamers[job_id] = streamer
        return streamer

    def _unregister(self, streamer: "Streamer") -> None:
        if self._streamers.get(streamer.job_id) is streamer:
            del self._streamers[streamer.job_id]

    def upload(self, job_id: str, attempt: int, local: Path, tidy: bool = True) -> Uploaded:
        """Copy one committed checkpoint folder to the store.

        Rank files this attempt's streamer has been sending are finished and moved into place
        when they are exactly the committed bytes; a blob that a checkpoint in the store already
        holds is copied there; every other file is sent now; the manifest goes last, so the
        checkpoint is complete in the store only once all of it is there. ``tidy=False`` leaves
        removing what it supersedes to the caller (`tidy`), after it has reported the checkpoint:
        removing a GB from a filesystem store took a tenth of a second or more."""
        newest = self._fenced(job_id)
        if attempt < newest:
            raise StaleAttempt(f"attempt {attempt} of {job_id} is stale (attempt {newest} has started)")
        remote = f"{self._job(job_id)}/{local.name}"
        self.fs.makedirs(remote, exist_ok=True)
        entries = json.loads((local / "manifest.json").read_text()).get("files") or {}
        streamer = self._streamers.get(job_id)
        step = committed_step(local.name)
        in_store = self.blobs_in_store(job_id, but=local.name)
        sent = reused = 0
        for f in _files(local):
            rel = f.relative_to(local).as_posix()
            stream = streamer.take(step, rel) if streamer is not None and streamer.attempt == attempt else None
            if stream is not None and stream.complete(f, entries.get(rel)):
                self.fs.mv(stream.path, f"{remote}/{rel}")
                sent += stream.sent
                continue
            if stream is not None:
                stream.discard()
            if "/" in rel:
                self.fs.makedirs(f"{remote}/{rel.rsplit('/', 1)[0]}", exist_ok=True)
            if rel.startswith(f"{BLOB_DIR}/"):
                moved = self.put_blob(f, f"{remote}/{rel}", in_store)
                sent, reused = sent + moved, reused + f.stat().st_size - moved
            else:
                self.fs.put_file(str(f), f"{remote}/{rel}")
                sent += f.stat().st_size
        publish(self.fs, local / "manifest.json", f"{remote}/manifest.json")  # last: marks it complete
        if tidy:
            self.tidy(job_id, attempt, step)
        if reused:
            log.info("uploaded %s of %s: %d bytes sent, %d bytes of unchanged blobs copied within the store",
                     local.name, job_id, sent, reused)
        return Uploaded(remote, sent, reused)

    def blobs_in_store(self, job_id: str, but: str = "") -> dict[str, tuple[str, int]]:
        """Digest -> (path, bytes) of the blobs of the job's complete checkpoints in the store
        (their manifests say which, newest first), leaving out the checkpoint named ``but``."""
        found: dict[str, tuple[str, int]] = {}
        if not self.reuse_blobs:
            return found
        for name in reversed(self._committed(job_id)):
            if name == but:
                continue
            folder = f"{self._job(job_id)}/{name}"
            try:
                manifest = json.loads(self.fs.cat_file(f"{folder}/manifest.json"))
            except (OSError, ValueError):
                continue  # pruned meanwhile, or unreadable: its blobs are simply sent again
            for blob, entry in (manifest.get("blobs") or {}).items():
                found.setdefault(blob, (f"{folder}/{BLOB_DIR}/{blob}", int(entry.get("bytes", -1))))
        return found

    def put_blob(self, local: Path, remote: str, in_store: dict[str, tuple[str, int]]) -> int:
        """Put the blob ``local`` at ``remote``: copied within the store when ``in_store`` (from
        `blobs_in_store`) has it with the same size, else sent. Returns the bytes sent."""
        known = in_store.get(local.name)
        if known is not None and known[1] == local.stat().st_size:
            try:
                copy_in_store(self.fs, known[0], remote)
                return 0
            except OSError as exc:  # pruned since the listing: send it
                log.info("copying %s within the store failed (%s); sending it", known[0], exc)
        self.fs.put_file(str(local), remote)
        return local.stat().st_size

    def tidy(self, job_id: str, attempt: int, step: Optional[int]) -> None:
        """Once checkpoint ``step`` of ``attempt`` is in the store: drop the stream folders it
        supersedes and the checkpoints beyond the newest two (best effort: the next upload tries
        again)."""
        try:
            self._forget_streams(job_id, attempt, step)
            self._prune(job_id, keep=2)
        except OSError as exc:
            log.info("tidying the store's folder of %s: %s (the next upload tries again)", job_id, exc)

    def _forget_streams(self, job_id: str, attempt: int, upto: Optional[int]) -> None:
        """Stream folders of this attempt's checkpoints up to ``upto`` are uploaded now (or were
        abandoned); those of older attempts can never be used."""
        base = f"{self._job(job_id)}/{STREAMS}"
        try:
            attempts = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return
        for entry in attempts:
            name = os.path.basename(entry.rstrip("/"))
            if not (name.startswith("a") and name[1:].isdigit()):
                continue
            if int(name[1:]) < attempt:
                self.fs.rm(entry, recursive=True)
            elif int(name[1:]) == attempt and upto is not None:
                for ck in self.fs.ls(entry, detail=False):
                    step = committed_step(os.path.basename(ck.rstrip("/")))
                    if step is not None and step <= upto:
                        self.fs.rm(ck, recursive=True)

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

    def download(self, job_id: str, keep: int = 2, upto: Optional[int] = None) -> int:
        """Fetch the newest ``keep`` complete checkpoints (of steps up to ``upto``, the one the
        server names) missing from the local cache (``cache_root/job_id``, what the worker
        restores from).

        Each one is fetched into a hidden staging folder and renamed, so a crash never leaves half
        of one. Returns the bytes of blobs linked from the cache rather than fetched."""
        linked = 0
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
            for entry, info in self.fs.find(remote, detail=True).items():
                rel = entry[len(remote):].strip("/")
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                if rel.startswith(f"{BLOB_DIR}/") and self.link_cached_blob(local_job, staging / rel, info.get("size")):
                    linked += int(info.get("size") or 0)
                    continue
                self.fs.get_file(entry, str(staging / rel))
            if (why := why_incomplete(staging)) is not None:
                log.warning("%s of %s in the store is damaged and was not fetched: %s", name, job_id, why)
                shutil.rmtree(staging, ignore_errors=True)
                continue
            os.replace(staging, target)
        return linked

    def link_cached_blob(self, local_job: Path, target: Path, nbytes: Any = None) -> bool:
        """Hard-link ``target`` (a blob, named by its digest) from a committed checkpoint of this
        node's cache of the job that holds it (with ``nbytes`` bytes, where known); False if none
        does (or reuse is off, or the link fails)."""
        if not self.reuse_blobs:
            return False
        for folder in CheckpointStore(local_job).checkpoints():
            source = folder / BLOB_DIR / target.name
            try:
                if nbytes is not None and source.stat().st_size != int(nbytes):
                    continue
                _link(source, target)
                return True
            except OSError:
                continue
        return False

    def exchange(self, job_id: str, attempt: int, world_size: int, local_ranks: Iterable[int]) -> "PartExchange":
        """The part exchange of one attempt of a job whose ranks are not all on this node."""
        return PartExchange(self, job_id, attempt, world_size, local_ranks)

    def clear(self, job_id: str) -> None:
        if self.fs.exists(self._job(job_id)):
            self.fs.rm(self._job(job_id), recursive=True)


def _link(source: Path, target: Path) -> None:
    """Hard-link ``source`` at ``target`` whole or not at all (a hidden name, then a rename)."""
    tmp = target.with_name(f".{target.name}.link")
    try:
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def copy_in_store(fs: Any, source: str, target: str) -> None:
    """Copy ``source`` to ``target`` without the bytes passing through this node: a hard link on
    a filesystem store (checkpoints that share a blob share its disk bytes there, as in the
    cache), else the store's own copy (S3's CopyObject, GCS's rewrite)."""
    if "file" in fs.protocol:
        try:
            _link(Path(source), Path(target))
            return
        except OSError:
            pass  # another filesystem under the store's root, or no hard links: copy
    fs.copy(source, target)


def _files(folder: Path) -> list[Path]:
    """The files of a committed checkpoint folder, blobs included, the manifest left out (it goes last)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / "manifest.json")


def why_incomplete(folder: Path) -> Optional[str]:
    """Why a fetched checkpoint is not whole (a file missing or of another size than its manifest
    says), else None. The digests are checked where the worker reads the bytes, not here: a pass
    over them at the agent would cost as much as the fetch."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        return f"manifest.json: {exc}"
    wanted = {n: e.get("bytes") for n, e in (manifest.get("files") or {}).items()}
    wanted.update({f"{BLOB_DIR}/{n}": e.get("bytes") for n, e in (manifest.get("blobs") or {}).items()})
    for name, nbytes in wanted.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != nbytes:
            return f"{name} has {size} bytes, the manifest says {nbytes}"
    return None


class _Stream:
    """One rank file on its way to the store while its worker writes it (the file is only ever
    appended to, so the bytes below its current size are final)."""

    def __init__(self, fs: Any, local: Path, remote: str) -> None:
        self.fs, self.path = fs, remote
        self.fd: Optional[int] = os.open(local, os.O_RDONLY)  # kept across the renames of the commit
        try:
            fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self.out: Any = fs.open(remote, "wb")
        except BaseException:
            os.close(self.fd)
            raise
        self.hash = digest.new()
        self.sent = 0

    def pump(self, limit: int = STREAM_CHUNK) -> int:
        """Send up to ``limit`` of the bytes written since the last turn; returns how many."""
        assert self.fd is not None
        data = os.pread(self.fd, limit, self.sent)
        if data:
            self.out.write(data)
            self.out.flush()  # into the store now, not when a buffer fills (a small rank file never would)
            self.hash.update(data)
            self.sent += len(data)
        return len(data)

    def complete(self, local: Path, entry: Optional[dict[str, Any]]) -> bool:
        """Send the rest of the committed file ``local``; whether the copy in the store is exactly
        the file its manifest ``entry`` describes (same file, size and digest)."""
        try:
            if entry is None or digest.NAME not in entry or self.fd is None:
                return False
            mine, theirs = os.fstat(self.fd), os.stat(local)
            if (mine.st_ino, mine.st_dev) != (theirs.st_ino, theirs.st_dev):
                return False  # a new file of the same name: what was sent is another one's bytes
            nbytes = int(entry["bytes"])
            while self.sent < nbytes and self.pump(min(STREAM_CHUNK, nbytes - self.sent)):
                pass
            return self.sent == nbytes == theirs.st_size and self.hash.hexdigest() == entry[digest.NAME]
        except OSError as exc:
            log.warning("streamed copy of %s unusable, uploading it whole: %s", local, exc)
            return False
        finally:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.out.close()

    def discard(self) -> None:
        """Close it and remove what was sent (best effort: a later upload removes leftovers)."""
        self.close()
        try:
            self.fs.rm(self.path)
        except (OSError, FileNotFoundError):
            pass


class Streamer:
    """Sends the rank files that one attempt writes on this node to the store while they are
    written, so that the upload of a checkpoint overlaps its write.

    A thread polls the job's staging folders (a directory listing every ``poll_s``) and moves a
    chunk of each file being written per turn, into ``streams/a<attempt>/ckpt-N/`` of the job's
    folder in the store, where no reader looks. `CheckpointTransfer.upload` takes the copies
    over once the checkpoint commits. The thread runs at a lower priority: during a periodic
    checkpoint the training loop goes on and must keep its core. A step is streamed only while
    the store's fence still names this attempt (checked once per step), and nothing streamed
    counts until `upload` has matched it against the manifest.
    """

    def __init__(self, transfer: "CheckpointTransfer", job_id: str, attempt: int, poll_s: float = 0.02):
        self.t, self.job_id, self.attempt, self.poll_s = transfer, job_id, attempt, poll_s
        self.streams: dict[tuple[int, str], _Stream] = {}
        self._seen: set[tuple[int, str]] = set()
        self._fenced_ok: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Streamer":
        self._thread = threading.Thread(target=self._loop, name=f"stream-{self.job_id}-a{self.attempt}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and drop the copies no upload took (their checkpoints never committed)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            left, self.streams = list(self.streams.values()), {}
        for s in left:
            s.discard()
        self.t._unregister(self)

    async def run(self, done: asyncio.Event) -> None:
        """Stream until the attempt's ranks here have exited."""
        if os.environ.get(STREAM_ENV, "0") != "1":
            self.t._unregister(self)
            return
        self.start()
        try:
            await done.wait()
        finally:
            await asyncio.to_thread(self.stop)

    def take(self, step: Optional[int], name: str) -> Optional[_Stream]:
        """The copy of ``name`` of checkpoint ``step``, no longer moved by the thread (the caller
        finishes it), or None if there is none."""
        with self._lock:
            return self.streams.pop((step, name), None) if step is not None else None

    def _loop(self) -> None:
        lower_this_thread()
        while not self._stopping.is_set():
            with self._lock:
                try:
                    self._follow()
                except OSError as exc:
                    log.warning("streaming checkpoints of %s: %s", self.job_id, exc)
                moved = self._pump()
            if not moved:
                self._stopping.wait(self.poll_s)

    def _follow(self) -> None:
        """Start a stream for each rank file that appeared in a staging folder."""
        local_job = self.t.cache_root / self.job_id
        names = [p.name for p in _listing(local_job)]
        entries = [(step, local_job / n) for n in names if (step := staging_step(n)) is not None]
        live = {step for step, _ in entries} | {s for n in names if (s := committed_step(n)) is not None}
        for key in [k for k in self.streams if k[0] not in live]:
            self.streams.pop(key).discard()  # its write failed: that checkpoint will never commit
        for step, folder in entries:
            for p in _listing(folder):
                m = _RANK_FILE.match(p.name)
                if m is None or (step, m.group(1)) in self._seen:
                    continue
                if not self._may_stream(step):
                    return
                self._seen.add((step, m.group(1)))
                self._open(step, folder, m.group(1))

    def _may_stream(self, step: int) -> bool:
        if step not in self._fenced_ok:
            self._fenced_ok[step] = self.t._fenced(self.job_id) <= self.attempt
            if not self._fenced_ok[step]:
                log.warning("attempt %d of %s is stale: its checkpoint %d is not streamed", self.attempt,
                            self.job_id, step)
        return self._fenced_ok[step]

    def _open(self, step: int, folder: Path, name: str) -> None:
        remote = f"{self.t._job(self.job_id)}/{STREAMS}/a{self.attempt}/ckpt-{step:08d}/{name}"
        for candidate in (folder / f"{name}.part", folder / name):  # renamed meanwhile: the second
            try:
                self.streams[(step, name)] = _Stream(self.t.fs, candidate, remote)
                return
            except FileNotFoundError:
                continue

    def _pump(self) -> int:
        """One turn: a chunk of each stream. A stream that fails is dropped (its file is then
        uploaded whole at the commit)."""
        moved = 0
        for key, s in list(self.streams.items()):
            try:
                moved += s.pump()
            except OSError as exc:
                log.warning("streaming %s of %s stopped: %s", key[1], self.job_id, exc)
                del self.streams[key]
                s.discard()
        return moved


def publish(fs: Any, local: Path, remote: str) -> None:
    """Put ``local`` at ``remote`` whole or not at all. A file whose presence says "complete" (a
    checkpoint's manifest, a part's side file) is read as soon as it is seen: a reader of a
    filesystem store must never find it half-copied. A hidden copy is renamed into place (on an
    object store, where objects only ever appear whole, this costs one more request)."""
    head, _, name = remote.rpartition("/")
    tmp = f"{head}/.{name}.part"
    fs.put_file(str(local), tmp)
    fs.mv(tmp, remote)


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []


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
                blobs = [b for b in json.loads(side.read_text()).get("blobs") or {} if b not in sent_blobs]
                in_store = self.t.blobs_in_store(self.job_id) if blobs else {}
                for blob in blobs:
                    self.t.put_blob(staging / BLOB_DIR / blob, f"{remote}/{BLOB_DIR}/{blob}", in_store)
                    sent_blobs.add(blob)
                self.t.fs.put_file(str(staging / f"rank-{rank}.pt"), f"{remote}/rank-{rank}.pt")
                publish(self.t.fs, side, f"{remote}/rank-{rank}.json")  # last: the part is complete
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
            if not self.t.link_cached_blob(staging.parent, target, nbytes):
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
