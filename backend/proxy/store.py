"""The on-disk checkpoint format: one folder per checkpoint, committed atomically.

Layout under a job's root::

    ckpt-00000042/              committed checkpoint of safe point 42
        rank-0.pt ... rank-{W-1}.pt
        manifest.json           format, step, world_size, created, files {name: {bytes, sha256}}
    .ckpt-00000043.tmp/         staging folder of a checkpoint being written (never read)

Every rank writes ``rank-R.pt.part``, fsyncs it and renames it to ``rank-R.pt`` next to a small
``rank-R.json`` with its size and sha256.  The rank that completes the set takes an exclusive
``.commit`` lock, writes ``manifest.json``, fsyncs, renames the staging folder to ``ckpt-*`` and
fsyncs the root.  A crash at any moment therefore leaves either the old set of committed
checkpoints or the old set plus a complete new one; ``latest()`` re-verifies sizes and sums.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from .errors import CheckpointError

FORMAT_VERSION = 1
_COMMITTED = re.compile(r"^ckpt-(\d{8,})$")
_STAGING = re.compile(r"^\.ckpt-(\d{8,})\.tmp$")
#: Test hook: seconds to sleep half-way through writing a rank file (so a test can kill -9 us).
SLEEP_HOOK_ENV = "SINGULARITY_PROXY_TEST_SLEEP_IN_WRITE"


class CheckpointDamaged(UserWarning):
    """Warning category for a committed checkpoint that fails verification."""


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint folder and what its manifest says."""

    path: Path
    step: int
    world_size: int
    created: str = ""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.pt"

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "world_size": self.world_size,
                "created": self.created, "files": self.files}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """File wrapper that hashes and counts what passes through (and hosts the test sleep hook)."""

    def __init__(self, f: BinaryIO, sleep_s: float) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.bytes = 0
        self._sleep_s = sleep_s

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        n = self._f.write(view)
        self.bytes += len(view)
        if self._sleep_s > 0:
            self._f.flush()
            os.fsync(self._f.fileno())
            print(f"[proxy] test hook: sleeping {self._sleep_s}s inside a checkpoint write",
                  file=sys.stderr, flush=True)
            time.sleep(self._sleep_s)
            self._sleep_s = 0.0
        return n if n is not None else len(view)

    def flush(self) -> None:
        self._f.flush()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    """All checkpoints of one job, in ``root``; keeps the newest ``keep`` committed ones."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.root = Path(root)
        self.keep = keep

    # ------------------------------------------------------------------ writing
    def write(self, step: int, rank: int, world_size: int,
              writer: Callable[[BinaryIO], None]) -> CheckpointRef:
        """Write this rank's file for ``step`` with ``writer(fileobj)``; commit when all are there.

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
        sleep_s = float(os.environ.get(SLEEP_HOOK_ENV, "0") or 0)
        try:
            with open(part, "wb") as raw:
                hw = _HashingWriter(raw, sleep_s)
                writer(hw)  # type: ignore[arg-type]
                raw.flush()
                os.fsync(raw.fileno())
        except BaseException:
            part.unlink(missing_ok=True)
            if world_size == 1:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        os.replace(part, staging / name)
        side = staging / f"rank-{rank}.json"
        side_tmp = staging / f"rank-{rank}.json.part"
        side_tmp.write_text(json.dumps({"bytes": hw.bytes, "sha256": hw.sha.hexdigest()}))
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
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "files": files,
        }
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

    def verify(self, path: Path) -> CheckpointRef:
        """Check a committed folder against its manifest; raise CheckpointError saying what is wrong."""
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
        for name, info in files.items():
            fp = path / name
            if not fp.exists():
                raise CheckpointError(f"{path}: {name} is missing")
            size = fp.stat().st_size
            if size != info.get("bytes"):
                raise CheckpointError(f"{path}: {name} has {size} bytes, manifest says {info.get('bytes')}")
            if _sha256_file(fp) != info.get("sha256"):
                raise CheckpointError(f"{path}: {name} does not match its sha256 (the file is corrupted)")
        return CheckpointRef(path, int(manifest["step"]), world_size, manifest.get("created", ""), files)

    def latest(self) -> Optional[CheckpointRef]:
        """Newest checkpoint that verifies; damaged ones are skipped with a warning naming them."""
        for _step, path in self._committed():
            try:
                return self.verify(path)
            except CheckpointError as e:
                warnings.warn(f"checkpoint {path} is damaged and was skipped: {e}",
                              CheckpointDamaged, stacklevel=2)
        return None

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, newest first (not verified)."""
        return [p for _s, p in self._committed()]

    # ------------------------------------------------------------------ cleanup
    def prune(self) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop staging folders older than them."""
        committed = self._committed()
        for _step, path in committed[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        newest = committed[0][0] if committed else -1
        if self.root.is_dir():
            for p in self.root.iterdir():
                m = _STAGING.match(p.name)
                if m and int(m.group(1)) <= newest:
                    shutil.rmtree(p, ignore_errors=True)

    def clear(self) -> None:
        """Remove every checkpoint and staging folder (the job succeeded)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if _COMMITTED.match(p.name) or _STAGING.match(p.name) or p.name.endswith(".old"):
                shutil.rmtree(p, ignore_errors=True)
