"""Content-addressed tensor storage, so a W-rank checkpoint stores replicated state once.

Data-parallel replicas hold bitwise-identical parameters and optimizer state after every step.
Written naively, a checkpoint of W ranks is W copies of the model.  Here each rank pickles its
object graph with a ``persistent_id`` that replaces every tensor by a reference to its *storage*,
stored once under the digest of its bytes (digest.py) in a blob folder shared by all ranks of the checkpoint.
The rank's own file keeps only the graph and per-tensor metadata (dtype, shape, stride, offset,
requires_grad), so a checkpoint's size is the distinct tensor bytes plus a few KB per rank.

Why storages and not tensors: views (a parameter and a slice of it, DDP's gradient bucket views)
must share memory again after loading, and the storage is what they share.  The digest covers
the raw bytes only; dtype and shape live in the reference, so identical bytes seen as two dtypes
are still one blob, and a view is rebuilt exactly.  Object identity is kept within one file: a
parameter referenced by the model and by its optimizer comes back as one object.

Concurrent writers: all W ranks write the same blobs at the same moment.  The first to link
``<digest>.claim`` into place (holding an exclusive ``flock`` on it; the empty file stays) writes
``<digest>`` (temp name, fsync, rename); the others skip it and, before their own rank file is
finished, wait for a shared lock on the claim.  The kernel drops a dead writer's lock, so a claim
left by a crashed attempt (same step, same bytes) is found unlocked with no blob, and the waiting
rank writes the blob itself.  Every rank therefore has all its blobs complete before its rank
file, and the checkpoint store commits only when every rank file is in.

Unchanged storages are not written again: a blob whose digest names a blob of the newest
committed checkpoint (``reuse_from``) is hard-linked from there instead (a link is complete or
absent, like a rename).  In a one-rank checkpoint only frozen parameters (``requires_grad``
False, at least `REUSABLE_BYTES`) go to blobs: a fine-tuned model's frozen backbone is then
hashed, not written, by every checkpoint after the first, while the rest stays inline.

Tensors with Python attributes (``param.foo = 1``) keep them: the attribute dict is pickled as the
tensor's state, set after the tensor exists, as ``torch.save`` does.

Small storages (at most `INLINE_BYTES`), and every storage when there is no blob folder (a
one-rank checkpoint), are written *inline*: their bytes follow the reference in the pickle
itself, once per storage, as an out-of-copy ``PickleBuffer`` (protocol 5).  A blob per tiny
tensor would cost a file and an fsync each (a model with 4,000 biases and norms took seconds),
and torch's zip archive costs a record per storage.
"""
from __future__ import annotations

import contextvars
import ctypes
import fcntl
import gc
import io
import os
import pickle
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Sequence, Union

import torch

from . import digest as digest_module
from .host_copy import to_host
from .store import BLOB_DIR, DigestMismatch

__all__ = ["BLOB_DIR", "BlobStore", "DumpStats", "dump", "dumps", "load", "dedup_pickler", "dedup_unpickler"]
_TAG = "sg-tensor"
#: storages up to this size go inline in the rank file rather than to a blob of their own
INLINE_BYTES = 64 << 10
#: a frozen parameter's storage this large goes to a blob in a one-rank checkpoint too, so the next
#: checkpoint can link it rather than write it again (`frozen_parameter`)
REUSABLE_BYTES = 1 << 20
#: threads that write a checkpoint's blobs: 250 blobs of 4 MB took 1.0-3.1 s one after another
#: on a VM disk, 0.6 s in 4 threads, as long as one file of the same bytes (each fsync waits alone)
BLOB_WRITERS = 4
#: at most this many bytes of blobs handed to the writing threads and not yet written
BLOB_IN_FLIGHT_BYTES = 512 << 20
Location = Union[None, str, torch.device, Callable[[torch.device], torch.device]]


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The raw bytes of a storage (copied to the host when it lives on a device: host_copy.py)."""
    if storage.device.type != "cpu":
        return memoryview(to_host(storage))
    if storage.nbytes() == 0:
        return memoryview(b"")
    return storage_memory(storage)


def storage_memory(storage: torch.UntypedStorage) -> memoryview:
    """A CPU storage's memory as writable bytes, the storage kept alive by the view (`_memory`)."""
    return _memory(storage.data_ptr(), storage.nbytes(), storage)


def _memory(address: int, nbytes: int, owner: Any) -> memoryview:
    """``nbytes`` of memory at ``address``, which ``owner`` keeps alive, as bytes. Not through
    ``Tensor.numpy()``: that marks the tensor's storage as not resizable for good, so every
    checkpoint made the program's tensors so, and ``buf.resize_(n)`` or a quantization observer
    (which resizes its buffers) then raised in the running program."""
    block = (ctypes.c_ubyte * nbytes).from_address(address)
    block.owner = owner  # type: ignore[attr-defined]  # alive as long as the view is
    return memoryview(block).cast("B")


def host_array(t: torch.Tensor) -> Any:
    """A numpy array sharing the memory of CPU tensor ``t``, which stays resizable (`_memory`);
    a dtype numpy lacks (bfloat16) as its bytes."""
    import numpy as np

    if t.dtype not in _NUMPY_DTYPES:
        t = t.detach().contiguous().reshape(-1).view(torch.uint8)
    size, storage = t.element_size(), t.untyped_storage()
    dtype = np.dtype(str(t.dtype).removeprefix("torch."))
    if storage.nbytes() == 0 or t.numel() == 0:
        return np.empty(tuple(t.shape), dtype=dtype)
    return np.ndarray(tuple(t.shape), dtype=dtype, buffer=_memory(storage.data_ptr(), storage.nbytes(), storage),
                      offset=t.storage_offset() * size, strides=tuple(s * size for s in t.stride()))


def frozen_parameter(t: torch.Tensor, nbytes: int) -> bool:
    """Whether a one-rank checkpoint sends this tensor's storage to a blob: a parameter no optimizer
    updates (``requires_grad`` False), large enough that linking beats writing it inline."""
    return isinstance(t, torch.nn.Parameter) and not t.requires_grad and nbytes >= REUSABLE_BYTES


def reusable(folders: Sequence[Path], digest: str, nbytes: int) -> Optional[Path]:
    """A complete blob of ``nbytes`` named ``digest`` in one of ``folders`` (committed
    checkpoints' blob folders), or None."""
    for folder in folders:
        path = Path(folder) / digest
        try:
            if path.stat().st_size == nbytes:
                return path
        except OSError:
            continue
    return None


class BlobStore:
    """A folder of blobs named by the digest of their contents, shared by a checkpoint's ranks.

    ``reuse_from``: blob folders of committed checkpoints; a blob found there with the same digest
    is hard-linked rather than written (`linked_bytes` counts them). ``verify_reads``: hash every
    blob as it is read (a one-rank checkpoint's blobs are not hashed before the restore).
    ``writers``: write blobs in that many threads (`put` returns at once; `wait` before relying on
    them), since one file and one fsync after another leaves the disk idle in between.
    """

    def __init__(self, folder: Path, reuse_from: Sequence[Path] = (), verify_reads: bool = False,
                 writers: int = 0) -> None:
        self.folder = Path(folder)
        self.reuse_from = tuple(reuse_from)
        self.verify_reads = verify_reads
        self.linked_bytes = 0
        self.writers = writers
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: list[tuple[Future, int]] = []  # (write, bytes), oldest first

    def path(self, digest: str) -> Path:
        return self.folder / digest

    def put(self, digest: str, data: memoryview) -> Optional[int]:
        """Store ``data`` under ``digest`` unless it is there (or link it: `link`); bytes written
        (with ``writers``: handed to a thread to write), None if another writer has it.

        None means the blob was claimed by someone else: call `settle` before relying on it.  The
        empty ``<digest>.claim`` file stays: removing it would let a rank that checked for the
        blob just before it appeared claim and write it a second time.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.path(digest).exists() or self.link(digest, len(data)):
            return 0
        fd = self._claim(digest)
        if fd is None:
            return None
        if not self.writers:
            return self._write_and_release(digest, data, fd)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.writers, thread_name_prefix="checkpoint-blob")
        # a device storage's bytes are a host copy held until written: bound what waits
        while self._pending and sum(n for _f, n in self._pending) + len(data) > BLOB_IN_FLIGHT_BYTES:
            self._pending.pop(0)[0].result()
        self._pending.append((self._pool.submit(self._write_and_release, digest, data, fd), len(data)))
        return len(data)

    def _write_and_release(self, digest: str, data: memoryview, claim_fd: int) -> int:
        try:
            return self._write(digest, data)
        finally:
            os.close(claim_fd)  # releases the claim's lock: waiting ranks find the blob

    def wait(self) -> None:
        """Until every blob `put` handed to the writing threads is complete; raises the first
        failure (the others are finished or given up first, and their claims released)."""
        pending, self._pending = self._pending, []
        try:
            for future, _n in pending:
                future.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def settle(self, digest: str, data: Callable[[], memoryview]) -> int:
        """Make sure a blob claimed by another writer exists; bytes this call wrote.

        Blocks while the claim's writer is alive and writing.  A claim left by a writer that died
        (a crashed attempt at the same step) is unlocked with no blob: write it ourselves.
        """
        if self.path(digest).exists():
            return 0
        try:
            fd = os.open(self.path(digest + ".claim"), os.O_RDONLY)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            finally:
                os.close(fd)
        if self.path(digest).exists():
            return 0
        view = data()
        return 0 if self.link(digest, len(view)) else self._write(digest, view)

    def _claim(self, digest: str) -> Optional[int]:
        """Create ``<digest>.claim`` already locked (link of a locked temp file); None if it exists."""
        tmp = self.path(f"{digest}.{os.getpid()}.{threading.get_ident()}.claiming")
        tmp.unlink(missing_ok=True)  # only a dead process with our pid could have left it
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.link(tmp, self.path(digest + ".claim"))
        except FileExistsError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return fd

    def link(self, digest: str, nbytes: int) -> bool:
        """Link the blob from a checkpoint of `reuse_from` that has it; False if none has (or the
        link fails: another filesystem)."""
        source = reusable(self.reuse_from, digest, nbytes)
        if source is None:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        part = self.path(f"{digest}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            os.link(source, part)
            os.replace(part, self.path(digest))
        except OSError:
            part.unlink(missing_ok=True)
            return False
        self.linked_bytes += nbytes
        return True

    def _write(self, digest: str, data: memoryview) -> int:
        """Temp name, fsync, rename: a blob is complete or absent (concurrent equal writes are fine).
        Callers link a blob an earlier checkpoint has first (`link`)."""
        part = self.path(f"{digest}.{os.getpid()}.{threading.get_ident()}.part")
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, self.path(digest))
        return len(data)

    def read(self, digest: str, nbytes: int) -> torch.UntypedStorage:
        """The blob as a fresh CPU storage (``nbytes`` is checked against the file)."""
        path = self.path(digest)
        size = path.stat().st_size
        if size != nbytes:
            raise ValueError(f"blob {digest} has {size} bytes, the reference expects {nbytes}")
        if nbytes == 0:
            return torch.UntypedStorage(0)
        storage = torch.UntypedStorage.from_file(str(path), False, nbytes)
        if self.verify_reads and digest_module.of_bytes(storage_bytes(storage)) != digest:
            raise DigestMismatch(f"blob {path} does not match its digest (the file is corrupted)")
        return storage

    def verify(self, digest: str) -> bool:
        return digest_module.of_file(self.path(digest), digest_module.algorithm_of(digest)) == digest

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
    storages: dict[str, int] = field(default_factory=dict)  # digest -> nbytes (blobs only)
    inline_bytes: int = 0
    blob_bytes_written: int = 0
    blob_bytes_linked: int = 0
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


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
#: dtypes whose tensors convert to numpy arrays without a copy
#: dtypes numpy has under the same name (`host_array`)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _blob_tensor(obj: Any) -> bool:
    """Tensors whose storage goes to a blob; others are pickled inline by torch's own reducers."""
    return (type(obj) in _TENSOR_TYPES and obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta")


def _set_attributes(obj: torch.Tensor, state: dict) -> None:
    for k, v in state.items():
        setattr(obj, k, v)


def dedup_pickler(base: type = pickle.Pickler) -> type:
    """A subclass of ``base`` (e.g. the engine's cloudpickle Pickler) that sends tensors to blobs.

    ``on_tensor`` (a constructor argument) is called once for every tensor it writes: the engine
    notes them there, to write their ``.grad`` at the end of the graph; a reduction it returns is
    used for that tensor instead.

    Tensors are reduced in ``reducer_override``, which pickle calls only for objects that are not
    builtin values or containers (a ``persistent_id`` would be called for every int and string:
    most of the time of a graph of many small tensors).  Pickle's memo keeps a tensor referenced
    twice one object; the storage index keeps views of one storage sharing it.
    """

    class DedupPickler(base):  # type: ignore[misc, valid-type]
        def __init__(self, file: BinaryIO, blobs: Optional[BlobStore], stats: DumpStats, protocol: int = 5,
                     on_tensor: Optional[Callable[[Any], None]] = None,
                     to_blob: Optional[Callable[[torch.Tensor, int], bool]] = None) -> None:
            super().__init__(file, protocol=protocol)
            self._on_tensor = on_tensor
            self._to_blob = to_blob
            self._blobs = blobs
            self._stats = stats
            self._storages: dict[int, tuple[int, Optional[str]]] = {}  # storage's _cdata -> (index, digest)
            self._keep: list[Any] = []  # keeps storages alive, so their _cdata stay unique
            #: blobs another writer claimed: `settle` them before the rank file counts as written
            self.claimed_elsewhere: dict[str, torch.UntypedStorage] = {}

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) in _TENSOR_TYPES and _blob_tensor(obj):
                return self._reduce_tensor(obj)
            parent = getattr(super(), "reducer_override", None)
            return parent(obj) if parent is not None else NotImplemented

        def _reduce_tensor(self, obj: torch.Tensor) -> tuple:
            if self._on_tensor is not None:
                replaced = self._on_tensor(obj)
                if replaced is not None:  # the caller saves this one its own way
                    return replaced
            storage = obj.untyped_storage()
            first = storage._cdata not in self._storages
            storage_index, digest = self._store(storage, obj)
            self._stats.tensors += 1
            meta = (digest, storage.nbytes(), _dtype_name(obj.dtype), tuple(obj.shape),
                    obj.stride(), obj.storage_offset(), obj.requires_grad,
                    type(obj) is torch.nn.Parameter, "cpu" if obj.is_cpu else str(obj.device), storage_index)
            # inline: the bytes follow the first reference to the storage, written without a copy
            inline = pickle.PickleBuffer(storage_bytes(storage)) if digest is None and first else None
            if obj.__dict__:  # attributes are set once the tensor exists (they may refer back to it)
                return _tensor_from_ref, (meta, inline), dict(obj.__dict__), None, None, _set_attributes
            return _tensor_from_ref, (meta, inline)

        def _store(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> tuple[int, Optional[str]]:
            """(index in this file, digest) of ``storage``; its blob is written the first time it is seen.

            The index, not the digest, says which tensors share memory: two storages with equal
            bytes (two zero-initialised biases) are one blob but stay two storages when loaded.
            The digest is None for a storage written inline: a small one, or one ``to_blob``
            (given) turns away.
            """
            known = self._storages.get(storage._cdata)
            if known is not None:
                return known
            self._keep.append(storage)
            if self._blobs is None or storage.nbytes() <= INLINE_BYTES or (
                    self._to_blob is not None and not self._to_blob(tensor, storage.nbytes())):
                known = self._storages[storage._cdata] = (len(self._storages), None)
                self._stats.inline_bytes += storage.nbytes()
                return known
            data = storage_bytes(storage)
            digest = digest_module.of_bytes(data)
            known = self._storages[storage._cdata] = (len(self._storages), digest)
            written = self._blobs.put(digest, data)
            if written is None:
                self.claimed_elsewhere.setdefault(digest, storage)
            else:
                self._stats.blob_bytes_written += written
            self._stats.storages[digest] = storage.nbytes()
            return known

    return DedupPickler


class _Loading:
    """What `_tensor_from_ref` needs while one file is unpickled: blobs, placement, storages seen."""

    def __init__(self, blobs: Optional[BlobStore], location: Location) -> None:
        self.blobs = blobs
        self.location = location
        self.storages: dict[int, torch.UntypedStorage] = {}  # storage index in the file -> storage


_LOADING: contextvars.ContextVar[Optional[_Loading]] = contextvars.ContextVar("sg_dedup_loading", default=None)


def _tensor_from_ref(meta: tuple, inline: Any) -> torch.Tensor:
    loading = _LOADING.get()
    if loading is None:
        raise pickle.UnpicklingError("a checkpoint tensor must be loaded with backend.proxy.checkpoint.dedup.load")
    return _make_tensor(loading, meta, inline)


def _make_tensor(loading: _Loading, meta: tuple, inline: Any) -> torch.Tensor:
    digest, nbytes, dtype, shape, stride, offset, requires_grad, is_param, device, storage_index = meta
    target = _device_of(loading.location, device)
    storage = loading.storages.get(storage_index)
    if storage is None:
        if digest is None:
            storage = _storage_from_buffer(inline, nbytes)
        elif loading.blobs is None:
            raise pickle.UnpicklingError(f"the checkpoint refers to blob {digest} but has no blob folder")
        else:
            storage = loading.blobs.read(digest, nbytes)
        if target.type != "cpu":
            storage = storage.to(device=target)
        loading.storages[storage_index] = storage
    t = torch.empty(0, dtype=getattr(torch, dtype), device=target)
    t.set_(storage, offset, shape, stride)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    return t


def dedup_unpickler(base: type = pickle.Unpickler) -> type:
    """A subclass of ``base`` that resolves `dedup_pickler`'s tensor references (and the persistent
    ids an earlier engine wrote instead)."""

    # the base's own rule for other persistent ids (``super().persistent_load`` of the C
    # unpickler returns this class's method again)
    other_ids = getattr(base, "persistent_load", None)
    if not isinstance(other_ids, types.FunctionType):
        other_ids = None

    class DedupUnpickler(base):  # type: ignore[misc, valid-type]
        def __init__(self, file: BinaryIO, blobs: Optional[BlobStore], map_location: Location = None) -> None:
            super().__init__(file)
            self._loading = _Loading(blobs, map_location)
            self._tensors: dict[int, torch.Tensor] = {}

        def load(self) -> Any:
            token = _LOADING.set(self._loading)
            try:
                return super().load()
            finally:
                _LOADING.reset(token)

        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and pid and pid[0] == _TAG):
                if other_ids is None:
                    raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
                return other_ids(self, pid)
            if len(pid) == 2:
                return self._tensors[pid[1]]
            _, index, meta = pid
            t = self._tensors[index] = _make_tensor(self._loading, meta, None)
            return t

    return DedupUnpickler


#: inline storages up to this size are copied into memory of torch's own, which can be resized
RESIZABLE_BYTES = 1 << 20


def _storage_from_buffer(data: Any, nbytes: int) -> torch.UntypedStorage:
    """A CPU storage over the bytes unpickled for an inline storage (no copy: it keeps them alive).

    Memory torch did not allocate cannot be resized: ``buf.resize_(n)``, ``torch.cat(..., out=buf)``
    and the per-channel observers of quantization-aware training (which resize their buffers)
    raised after a restore. So a small storage (up to `RESIZABLE_BYTES`, where such buffers are)
    is copied into a storage of torch's own; a large one is not (a copy of every byte would slow
    every restore)."""
    if len(data) != nbytes:
        raise pickle.UnpicklingError(f"an inline storage has {len(data)} bytes, its reference expects {nbytes}")
    if nbytes == 0:
        return torch.UntypedStorage(0)
    if nbytes <= RESIZABLE_BYTES:
        return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)
    if isinstance(data, bytes):
        data = bytearray(data)  # torch.frombuffer needs writable memory
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()


def dump(obj: Any, f: BinaryIO, blobs: Optional[BlobStore], pickler: Optional[type] = None,
         protocol: int = 5, on_tensor: Optional[Callable[[Any], None]] = None,
         prepare: Optional[Callable[[Any], None]] = None,
         to_blob: Optional[Callable[[torch.Tensor, int], bool]] = None) -> DumpStats:
    """Pickle ``obj`` to ``f`` with its tensors' storages in ``blobs`` (inline when None or small,
    or, with ``to_blob``, when it says no for the first tensor seen on the storage).

    ``prepare(pickler)`` runs before the dump (to start its memo with what a pickle before this
    one in ``f`` memoised).

    Returns once every blob the pickle references is complete (including ones other writers
    claimed), so a rank file written after it never points at a missing blob.
    """
    stats = DumpStats()
    counter = _Counting(f)
    p = dedup_pickler(pickler or pickle.Pickler)(counter, blobs, stats, protocol, on_tensor, to_blob)
    linked_before = getattr(blobs, "linked_bytes", 0)
    if prepare is not None:
        prepare(p)
    collecting = gc.isenabled()
    gc.disable()  # pickling makes no garbage cycles; a full collection mid-way doubled its time
    try:
        p.dump(obj)
    finally:
        if collecting:
            gc.enable()
        if isinstance(blobs, BlobStore):
            blobs.wait()  # every blob complete (or the failure raised) before the rank file is
    for digest, storage in p.claimed_elsewhere.items():
        stats.blob_bytes_written += blobs.settle(digest, lambda s=storage: storage_bytes(s))
    stats.blob_bytes_linked = getattr(blobs, "linked_bytes", 0) - linked_before
    stats.file_bytes = counter.bytes
    return stats


def load(f: BinaryIO, blobs: Optional[BlobStore], unpickler: Optional[type] = None,
         map_location: Location = None) -> Any:
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
