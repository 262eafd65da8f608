"""Content-addressed tensor storage, so a W-rank checkpoint stores replicated state once.

Data-parallel replicas hold bitwise-identical parameters and optimizer state after every step.
Written naively, a checkpoint of W ranks is W copies of the model.  Here each rank pickles its
object graph with a ``persistent_id`` that replaces every tensor by a reference to its *storage*,
stored once under the sha256 of its bytes in a blob folder shared by all ranks of the checkpoint.
The rank's own file keeps only the graph and per-tensor metadata (dtype, shape, stride, offset,
requires_grad), so a checkpoint's size is the distinct tensor bytes plus a few KB per rank.

Why storages and not tensors: views (a parameter and a slice of it, DDP's gradient bucket views)
must share memory again after loading, and the storage is what they share.  The digest covers
the raw bytes only; dtype and shape live in the reference, so identical bytes seen as two dtypes
are still one blob, and a view is rebuilt exactly.  Object identity is kept within one file: a
parameter referenced by the model and by its optimizer comes back as one object.

Concurrent writers: all W ranks write the same blobs at the same moment.  The first to create
``<digest>.claim`` (``O_EXCL``; the empty file stays) writes ``<digest>`` (temp name, fsync,
rename); the others skip it.  Every rank writes its blobs before its rank file, and the checkpoint store commits only
when every rank file is in, so a committed checkpoint has every blob complete.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

import torch

BLOB_DIR = "blobs"
_TAG = "sg-tensor"
Location = Union[None, str, torch.device, Callable[[torch.device], torch.device]]


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The raw bytes of a storage (copied to the host when it lives on a device)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    if storage.nbytes() == 0:
        return memoryview(b"")
    t = torch.empty(0, dtype=torch.uint8)
    t.set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(t.numpy()).cast("B")


class BlobStore:
    """A folder of blobs named by the sha256 of their contents, shared by a checkpoint's ranks."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def path(self, digest: str) -> Path:
        return self.folder / digest

    def put(self, digest: str, data: memoryview) -> int:
        """Store ``data`` under ``digest`` unless some rank has it or is writing it; bytes written.

        The empty ``<digest>.claim`` file stays: removing it would let a rank that checked for the
        blob just before it appeared claim and write it a second time.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(digest)
        if final.exists():
            return 0
        try:
            fd = os.open(self.path(digest + ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return 0  # another rank writes it, before its own rank file (see the module docstring)
        os.close(fd)
        part = self.path(f"{digest}.{os.getpid()}.{threading.get_ident()}.part")
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, final)
        return len(data)

    def read(self, digest: str, nbytes: int) -> torch.UntypedStorage:
        """The blob as a fresh CPU storage (``nbytes`` is checked against the file)."""
        path = self.path(digest)
        size = path.stat().st_size
        if size != nbytes:
            raise ValueError(f"blob {digest} has {size} bytes, the reference expects {nbytes}")
        if nbytes == 0:
            return torch.UntypedStorage(0)
        return torch.UntypedStorage.from_file(str(path), False, nbytes)

    def verify(self, digest: str) -> bool:
        h = hashlib.sha256()
        with open(self.path(digest), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() == digest

    def digests(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.iterdir() if "." not in p.name)

    def total_bytes(self) -> int:
        return sum(self.path(d).stat().st_size for d in self.digests())


@dataclass
class DumpStats:
    """What one rank's `dump` did: the distinct storages it referenced and the bytes it wrote."""

    tensors: int = 0
    storages: dict[str, int] = field(default_factory=dict)  # digest -> nbytes
    blob_bytes_written: int = 0
    file_bytes: int = 0

    @property
    def referenced_bytes(self) -> int:
        return sum(self.storages.values())


def _device_of(location: Location, saved: str) -> torch.device:
    device = torch.device(saved)
    if location is None:
        if device.type == "cuda" and not torch.cuda.is_available():
            return torch.device("cpu")
        return device
    if callable(location):
        return torch.device(location(device))
    return torch.device(location)


def dedup_pickler(base: type = pickle.Pickler) -> type:
    """A subclass of ``base`` (e.g. the engine's cloudpickle Pickler) that sends tensors to blobs."""

    class DedupPickler(base):  # type: ignore[misc, valid-type]
        def __init__(self, file: BinaryIO, blobs: BlobStore, stats: DumpStats, protocol: int = 4) -> None:
            super().__init__(file, protocol=protocol)
            self._blobs = blobs
            self._stats = stats
            self._seen: dict[int, int] = {}  # id(tensor) -> index, for identity
            self._keep: list[Any] = []  # keeps ids stable while pickling
            self._digests: dict[tuple[int, int], str] = {}  # (data_ptr, nbytes) -> digest

        def persistent_id(self, obj: Any) -> Any:
            if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
                return None
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
                return None  # pickled inline by torch's own reducers
            index = self._seen.get(id(obj))
            if index is not None:
                return (_TAG, index)
            index = len(self._seen)
            self._seen[id(obj)] = index
            self._keep.append(obj)
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            digest = self._digests.get(key)
            if digest is None:
                data = storage_bytes(storage)
                digest = hashlib.sha256(data).hexdigest()
                self._digests[key] = digest
                self._stats.blob_bytes_written += self._blobs.put(digest, data)
            self._stats.storages[digest] = storage.nbytes()
            self._stats.tensors += 1
            meta = (digest, storage.nbytes(), str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                    tuple(obj.stride()), obj.storage_offset(), bool(obj.requires_grad),
                    isinstance(obj, torch.nn.Parameter), str(obj.device))
            return (_TAG, index, meta)

    return DedupPickler


def dedup_unpickler(base: type = pickle.Unpickler) -> type:
    """A subclass of ``base`` that resolves `dedup_pickler`'s tensor references."""

    class DedupUnpickler(base):  # type: ignore[misc, valid-type]
        def __init__(self, file: BinaryIO, blobs: BlobStore, map_location: Location = None) -> None:
            super().__init__(file)
            self._blobs = blobs
            self._location = map_location
            self._tensors: dict[int, torch.Tensor] = {}
            self._storages: dict[tuple[str, str], torch.UntypedStorage] = {}

        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and pid and pid[0] == _TAG):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
            if len(pid) == 2:
                return self._tensors[pid[1]]
            _, index, meta = pid
            digest, nbytes, dtype, shape, stride, offset, requires_grad, is_param, device = meta
            target = _device_of(self._location, device)
            storage = self._storages.get((digest, str(target)))
            if storage is None:
                storage = self._blobs.read(digest, nbytes)
                if target.type != "cpu":
                    storage = storage.to(device=target)
                self._storages[(digest, str(target))] = storage
            t = torch.empty(0, dtype=getattr(torch, dtype), device=target)
            t.set_(storage, offset, shape, stride)
            if is_param:
                t = torch.nn.Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            self._tensors[index] = t
            return t

    return DedupUnpickler


def dump(obj: Any, f: BinaryIO, blobs: BlobStore, pickler: Optional[type] = None, protocol: int = 4) -> DumpStats:
    """Pickle ``obj`` to ``f`` with its tensors' storages in ``blobs``."""
    stats = DumpStats()
    counter = _Counting(f)
    dedup_pickler(pickler or pickle.Pickler)(counter, blobs, stats, protocol).dump(obj)
    stats.file_bytes = counter.bytes
    return stats


def load(f: BinaryIO, blobs: BlobStore, unpickler: Optional[type] = None, map_location: Location = None) -> Any:
    """Read what `dump` wrote; storages shared by several tensors are loaded once."""
    return dedup_unpickler(unpickler or pickle.Unpickler)(f, blobs, map_location).load()


def dumps(obj: Any, blobs: BlobStore) -> bytes:
    buf = io.BytesIO()
    dump(obj, buf, blobs)
    return buf.getvalue()


class _Counting:
    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.bytes = 0

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        self.bytes += n
        self._f.write(data)
        return n
