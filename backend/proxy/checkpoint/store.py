"""The on-disk checkpoint format: one folder per checkpoint, committed atomically.

Layout under a job's root::

    ckpt-00000042/              committed checkpoint of safe point 42
        rank-0.pt ... rank-{W-1}.pt
        blobs/<digest>          W > 1: tensor storages shared by the ranks (see dedup.py)
        manifest.json           format, step, world_size, created, files {name: {bytes, xxh3_128}},
                                blobs {digest: {bytes}} (only when there are blobs)
    .ckpt-00000043.tmp/         staging folder of a checkpoint being written (never read)

Every rank writes ``rank-R.pt.part``, fsyncs it and renames it to ``rank-R.pt`` next to a small
``rank-R.json`` with its size and digest (digest.py).  The rank that completes the set takes an exclusive
``.commit`` lock, writes ``manifest.json``, fsyncs, renames the staging folder to ``ckpt-*`` and
fsyncs the root.  A crash at any moment therefore leaves either the old set of committed
checkpoints or the old set plus a complete new one; ``latest()`` re-verifies sizes and sums.

A writer may also put content-addressed blobs in ``blobs/`` of the staging folder
(`RankFile.blob_dir`) and say which ones its rank file needs (`RankFile.blobs`); they must be
complete before the writer returns.  The committing rank checks that every needed blob is there,
drops everything else from ``blobs/`` (claims, temp files, blobs of a failed attempt) and lists
the blobs in the manifest, so they are verified like rank files.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from . import digest
from .errors import CheckpointError

FORMAT_VERSION = 1
#: folder of a checkpoint holding the blobs its rank files reference (`dedup.BlobStore`)
BLOB_DIR = "blobs"
_COMMITTED = re.compile(r"^ckpt-(\d{8,})$")
_STAGING = re.compile(r"^\.ckpt-(\d{8,})\.tmp$")
#: the end of a pruned folder's name once it is renamed out of readers' sight, until it is removed
PRUNED_SUFFIX = ".pruned"
_pruned_names = itertools.count()
#: Test hook: seconds to sleep half-way through writing a rank file (so a test can kill -9 us).
SLEEP_HOOK_ENV = "SINGULARITY_PROXY_TEST_SLEEP_IN_WRITE"
#: Test hook: a file; half-way through writing a rank file, wait while it exists (at most
#: `HOLD_LIMIT_S`), so a test can look at a write in flight, or kill it, however slow the machine
HOLD_HOOK_ENV = "SINGULARITY_PROXY_TEST_HOLD_IN_WRITE"
HOLD_LIMIT_S = 120.0
#: in a job's root: which place its ranks' parts meet in (`meeting_point`)
MEETING_FILE = ".parts-meet"


#: niceness added to a thread that writes or uploads checkpoints behind the training loop, so on
#: a small machine it yields the core to the loop
BACKGROUND_NICENESS = 10


def lower_this_thread() -> None:
    """Add `BACKGROUND_NICENESS` to the calling thread's (Linux: a thread's niceness is its own;
    best effort elsewhere). Added, not set: the worker already stands behind the control plane
    (backend/worker/main.py), and the writer must still stand behind the loop."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS))
    except (AttributeError, OSError):
        pass


def committed_step(name: str) -> Optional[int]:
    """The step of a committed checkpoint's folder name (``ckpt-00000042``), else None."""
    m = _COMMITTED.match(name)
    return int(m.group(1)) if m else None


def staging_step(name: str) -> Optional[int]:
    """The step of a checkpoint being written, from its staging folder's name, else None."""
    m = _STAGING.match(name)
    return int(m.group(1)) if m else None


def meeting_point(root: Path) -> int:
    """A number for the place where the parts of the checkpoints in ``root`` come together.

    Ranks that read the same number put their parts where one of them can commit the set: the
    first to look draws it at random, so ranks sharing the folder (one node, or nodes on one
    shared filesystem) read the same one, and ranks on nodes with folders of their own read
    different ones. An agent that brings the parts together through a store writes one derived
    from the store and the job on each of its nodes before the ranks start (agent/transfer.py).
    """
    path = Path(root) / MEETING_FILE
    try:
        return int(path.read_text()[:15], 16)
    except (FileNotFoundError, ValueError):
        pass
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{MEETING_FILE}.{os.getpid()}.{os.urandom(4).hex()}")
    tmp.write_text(os.urandom(8).hex())
    try:
        os.link(tmp, path)  # atomic and exclusive, with its content, also on NFS
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return int(path.read_text()[:15], 16)


class CheckpointDamaged(UserWarning):
    """Warning category for a committed checkpoint that fails verification."""


class DigestMismatch(CheckpointError):
    """A file's bytes, hashed while they were read, differ from its manifest's digest."""


def expected_digest(ref: "CheckpointRef", name: str) -> tuple[str, Optional[str]]:
    """(algorithm, digest) the manifest of ``ref`` records for its file ``name``."""
    return _entry_digest(ref.files.get(name) or {})


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint folder and what its manifest says."""

    path: Path
    step: int
    world_size: int
    created: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    blobs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.pt"

    @property
    def blob_dir(self) -> Path:
        return self.path / BLOB_DIR

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "world_size": self.world_size,
                "created": self.created, "files": self.files, "blobs": self.blobs}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RankFile:
    """What a writer gets: this rank's file (hashed and counted as it passes) and the blob folder.

    ``blob_dir`` is shared by all ranks of the checkpoint; a writer that stores blobs there
    records the ones its file references in ``blobs`` (digest -> bytes) so the commit can check
    them.  ``reuse_from`` names blob folders of committed checkpoints whose blobs may be linked
    rather than written again (`dedup.BlobStore`).  It also hosts the test hooks (`SLEEP_HOOK_ENV`,
    `HOLD_HOOK_ENV`).
    """

    def __init__(self, f: BinaryIO, blob_dir: Path) -> None:
        self._f = f
        self.hash = digest.new()
        self.bytes = 0
        self._sleep_s = float(os.environ.get(SLEEP_HOOK_ENV, "0") or 0)
        self._hold = os.environ.get(HOLD_HOOK_ENV) or None
        self.blob_dir = blob_dir
        self.blobs: dict[str, int] = {}
        self.reuse_from: list[Path] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        n = self._f.write(view)
        self.bytes += len(view)
        if self._sleep_s > 0 or self._hold:
            self._pause()
        return n if n is not None else len(view)

    def _pause(self) -> None:
        """The test hooks: once per file, after its first write (on disk, so others can see it)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._sleep_s > 0:
            print(f"[proxy] test hook: sleeping {self._sleep_s}s inside a checkpoint write", file=sys.stderr, flush=True)
            time.sleep(self._sleep_s)
        if self._hold and os.path.exists(self._hold):
            print(f"[proxy] test hook: holding a checkpoint write while {self._hold} exists", file=sys.stderr,
                  flush=True)
            end = time.monotonic() + HOLD_LIMIT_S
            while os.path.exists(self._hold) and time.monotonic() < end:
                time.sleep(0.01)
        self._sleep_s, self._hold = 0.0, None

    def flush(self) -> None:
        self._f.flush()


def _entry_digest(info: dict[str, Any]) -> tuple[str, Any]:
    """(algorithm, digest) of a manifest file entry (earlier engines recorded sha256)."""
    for name in digest.KNOWN:
        if name in info:
            return name, info[name]
    return digest.NAME, None


def _check_file(folder: Path, name: str, nbytes: Any, expected: Any, algorithm: str = digest.NAME) -> None:
    """Raise CheckpointError unless ``folder/name`` has the recorded size and digest (None: size only)."""
    fp = folder / name
    if not fp.exists():
        raise CheckpointError(f"{folder}: {name} is missing")
    size = fp.stat().st_size
    if size != nbytes:
        raise CheckpointError(f"{folder}: {name} has {size} bytes, manifest says {nbytes}")
    if expected is not None and digest.of_file(fp, algorithm) != expected:
        raise CheckpointError(f"{folder}: {name} does not match its {algorithm} digest (the file is corrupted)")


def _settle_blobs(folder: Path, files: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The blobs the rank files reference (taken out of ``files``), checked complete; the rest is removed.

    Runs once every rank file is in, when no writer of this checkpoint is still writing blobs:
    anything unreferenced is a claim, a temp file, or a blob of an attempt that failed.
    """
    needed: dict[str, tuple[int, str]] = {}
    for name, info in files.items():
        for blob, nbytes in (info.pop("blobs", None) or {}).items():
            needed.setdefault(blob, (int(nbytes), name))
    if not folder.is_dir():
        if needed:
            raise CheckpointError(f"{folder} is missing; the rank files reference {len(needed)} blobs")
        return {}
    if not needed:
        shutil.rmtree(folder)
        return {}
    for p in folder.iterdir():
        if p.name not in needed:
            p.unlink(missing_ok=True)
    for blob, (nbytes, name) in needed.items():
        size = (folder / blob).stat().st_size if (folder / blob).exists() else None
        if size != nbytes:
            raise CheckpointError(f"cannot commit: blob {blob} referenced by {name} "
                                  f"{'is missing' if size is None else f'has {size} bytes, not {nbytes}'}")
    _fsync_dir(folder)
    return {d: {"bytes": n} for d, (n, _name) in sorted(needed.items())}


class CheckpointStore:
    """All checkpoints of one job, in ``root``; keeps the newest ``keep`` committed ones."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.root = Path(root)
        self.keep = keep

    # ------------------------------------------------------------------ writing
    def write(self, step: int, rank: int, world_size: int,
              writer: Callable[[RankFile], None]) -> CheckpointRef:
        """Write this rank's file for ``step`` with ``writer(rank_file)``; commit when all are there.

        ``rank_file`` is file-like (``write``) and names the checkpoint's blob folder (`RankFile`).
        If ``writer`` raises, the partial file is removed and the exception propagates; nothing
        committed changes.  Returns the reference the checkpoint has (or will have once the last
        rank commits it).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".ckpt-{step:08d}.tmp"
        if world_size == 1 and staging.exists():
            shutil.rmtree(staging)  # left by a crashed earlier attempt at this step
        staging.mkdir(exist_ok=True)
        name = f"rank-{rank}.pt"
        part = staging / (name + ".part")
        try:
            with open(part, "wb") as raw:
                hw = RankFile(raw, staging / BLOB_DIR)
                hw.reuse_from = self.reusable_blob_dirs()
                writer(hw)
                raw.flush()
                os.fsync(raw.fileno())
        except BaseException as exc:
            part.unlink(missing_ok=True)
            if world_size == 1:
                shutil.rmtree(staging, ignore_errors=True)
            else:  # the set will never be complete: say so to whoever waits for its commit
                try:
                    (staging / f"rank-{rank}.failed").write_text(f"{type(exc).__name__}: {exc}")
                except OSError:
                    pass
            raise
        os.replace(part, staging / name)
        side = staging / f"rank-{rank}.json"
        side_tmp = staging / f"rank-{rank}.json.part"
        side_tmp.write_text(json.dumps({"bytes": hw.bytes, digest.NAME: hw.hash.hexdigest(), "blobs": hw.blobs}))
        with open(side_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(side_tmp, side)
        _fsync_dir(staging)
        final = self.root / f"ckpt-{step:08d}"
        self._try_commit(staging, final, step, world_size)
        return CheckpointRef(final, step, world_size)

    def _try_commit(self, staging: Path, final: Path, step: int, world_size: int) -> None:
        sides = [staging / f"rank-{r}.json" for r in range(world_size)]
        if not all(p.exists() for p in sides):
            return  # another rank will complete the set
        try:
            fd = os.open(staging / ".commit", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return  # another rank is committing
        os.close(fd)
        files = {f"rank-{r}.pt": json.loads(sides[r].read_text()) for r in range(world_size)}
        blobs = _settle_blobs(staging / BLOB_DIR, files)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "files": files,
        }
        if blobs:
            manifest["blobs"] = blobs
        tmp = staging / "manifest.json.part"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, staging / "manifest.json")
        for p in sides:
            p.unlink()
        (staging / ".commit").unlink()
        _fsync_dir(staging)
        if final.exists():  # a checkpoint of the same step from an earlier attempt
            trash = self.root / f".ckpt-{step:08d}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)
        _fsync_dir(self.root)
        self.prune()

    @staticmethod
    def failed_parts(final: Path) -> list[str]:
        """What the ranks whose part of checkpoint ``final`` could not be written said (empty
        while the set may still complete)."""
        staging = final.parent / f".{final.name}.tmp"
        try:
            return [p.read_text() for p in staging.glob("rank-*.failed")]
        except OSError:
            return []

    # ------------------------------------------------------------------ reading
    def _committed(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _COMMITTED.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def verify(self, path: Path, contents: Optional[bool] = None) -> CheckpointRef:
        """Check a committed folder against its manifest; raise CheckpointError saying what is wrong.

        ``contents`` (default: only for several ranks) also hashes every file.  A one-rank
        checkpoint's only file is hashed while the restore reads it (`state.load_graph`), which
        saves a whole pass over the bytes; several ranks must all agree on the checkpoint they
        restore before any reads its own file, so each checks them all first.
        """
        mpath = path / "manifest.json"
        try:
            manifest = json.loads(mpath.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: manifest.json is missing") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: manifest.json is unreadable ({e})") from None
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format {manifest.get('format')!r}, this proxy reads {FORMAT_VERSION}")
        files = manifest.get("files") or {}
        world_size = int(manifest.get("world_size", 0))
        expected = {f"rank-{r}.pt" for r in range(world_size)}
        if set(files) != expected:
            raise CheckpointError(f"{path}: manifest lists {sorted(files)}, expected {sorted(expected)}")
        if contents is None:
            contents = world_size > 1
        for name, info in files.items():
            algorithm, expected = _entry_digest(info)
            _check_file(path, name, info.get("bytes"), expected if contents else None, algorithm)
        blobs = manifest.get("blobs") or {}
        for name, info in blobs.items():  # a blob is named by its digest
            _check_file(path, f"{BLOB_DIR}/{name}", info.get("bytes"), name if contents else None,
                        digest.algorithm_of(name))
        return CheckpointRef(path, int(manifest["step"]), world_size, manifest.get("created", ""), files, blobs)

    def latest(self, before: Optional[int] = None, contents: Optional[bool] = None) -> Optional[CheckpointRef]:
        """Newest checkpoint (below step ``before``) that verifies (``contents`` as for `verify`);
        damaged ones are skipped with a warning naming them."""
        for step, path in self._committed():
            if before is not None and step >= before:
                continue
            try:
                return self.verify(path, contents)
            except CheckpointError as e:
                warnings.warn(f"checkpoint {path} is damaged and was skipped: {e}",
                              CheckpointDamaged, stacklevel=2)
        return None

    def reusable_blob_dirs(self) -> list[Path]:
        """Blob folders a new checkpoint may link unchanged blobs from: the newest committed
        checkpoint's (each checkpoint links or writes every blob it needs, so the newest has them
        all).  Blobs are named by their content, so any committed folder is as good."""
        for _step, path in self._committed():
            blob_dir = path / BLOB_DIR
            return [blob_dir] if blob_dir.is_dir() else []
        return []

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, newest first (not verified)."""
        return [p for _s, p in self._committed()]

    # ------------------------------------------------------------------ cleanup
    def prune(self) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop staging folders older than them.

        A dropped folder is renamed out of sight at once (no reader ever meets a half-removed
        checkpoint) and removed by a thread behind the caller: unlinking a GB took 0.1-0.3 s on a
        VM's disk, on the critical path of every preemption's commit. What a process does not live
        to remove (it exits right after a preemption's commit) is removed by the next prune, by the
        agent once the worker has exited (`remove_pruned`), or with everything by `clear`."""
        committed = self._committed()
        doomed = [path for _step, path in committed[self.keep:]]
        newest = committed[0][0] if committed else -1
        if self.root.is_dir():
            for p in self.root.iterdir():
                m = _STAGING.match(p.name)
                if m and int(m.group(1)) <= newest:
                    doomed.append(p)
        for path in doomed:
            try:
                os.replace(path, self.root / f".{path.name.lstrip('.')}.{os.getpid()}-{next(_pruned_names)}{PRUNED_SUFFIX}")
            except OSError:
                shutil.rmtree(path, ignore_errors=True)
        if self._pruned():
            threading.Thread(target=self.remove_pruned, args=(True,), name="checkpoint-prune", daemon=True).start()

    def _pruned(self) -> list[Path]:
        try:
            return [p for p in self.root.iterdir() if p.name.endswith(PRUNED_SUFFIX)]
        except FileNotFoundError:
            return []

    def remove_pruned(self, behind: bool = False) -> int:
        """Remove the folders `prune` renamed out of sight (``behind``: at the background's
        priority, from the thread `prune` starts); returns how many."""
        if behind:
            lower_this_thread()
        pruned = self._pruned()
        for path in pruned:
            shutil.rmtree(path, ignore_errors=True)
        return len(pruned)

    def discard_staging(self, after: int) -> None:
        """Remove staging folders of steps above ``after`` (called when a job restores from ``after``).

        They are left by an attempt that crashed while writing; the restored run will reach those
        steps again and must not find that attempt's rank files or blob claims there.
        """
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            m = _STAGING.match(p.name)
            if m and int(m.group(1)) > after:
                shutil.rmtree(p, ignore_errors=True)

    def discard_after(self, step: int) -> list[Path]:
        """Remove committed checkpoints (and staging folders) of steps above ``step``; returns the
        checkpoints removed. Called before a restore the service names: a newer checkpoint was
        written by an attempt whose report never arrived (a partitioned node's lease), so its
        output is not in the job's log, and a later restore must not pick it."""
        self.discard_staging(step)
        gone = [path for s, path in self._committed() if s > step]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def clear(self) -> None:
        """Remove every checkpoint and staging folder (the job succeeded)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if _COMMITTED.match(p.name) or _STAGING.match(p.name) or p.name.endswith((".old", PRUNED_SUFFIX)):
                shutil.rmtree(p, ignore_errors=True)
