"""The random generators of persistent DataLoader workers, and their Dataset's state, carried
across a restore.

A worker process seeds its generators once, when it starts. With ``persistent_workers=True`` it
keeps them epoch after epoch, so what a random augmentation in ``__getitem__`` gives in epoch 3
depends on every item that worker loaded before. A restore starts new workers; to load the same
items they must begin the epoch with the generators the old ones had. Replaying the earlier
epochs would cost hours, so each worker records its generators instead, in memory it shares with
the job (an anonymous shared mapping made before the workers fork):

* ``start``: at each epoch's start (each time the worker makes its fetcher: at its start and at
  every ``iter(loader)`` that resets the kept iterator);
* ``latest``: after each batch it loads (70 us, against a batch's milliseconds);
* ``override``: written by the job at a restore, put into the generators by the worker when it
  makes its fetcher for the epoch numbered in the slot.

A checkpoint of an iterator in the middle of an epoch carries the ``start`` states (the restore
replays the epoch's batches from them); one of an iterator its loop has finished carries the
``latest`` states (the next ``iter(loader)`` begins the next epoch from them).

Workers started by ``spawn`` or ``forkserver`` do not inherit the mapping: no states are
recorded and the loop warns as before (iterators.describe).
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import pickle
import random
import struct
import sys
import time
from typing import Any, Optional

from ..checkpoint.errors import CheckpointFailure

SLOT = 64 * 1024
#: how long a checkpoint waits for a worker to record an epoch's states (a reset waits for every
#: worker to take it up, and a worker makes its fetcher just after: longer means a worker is lost)
WAIT_S = 10.0
_HEADER = struct.Struct("<QII")  # sequence number (odd while written), epoch tag, payload length
START, LATEST, OVERRIDE = range(3)
ATTR = "_sg_worker_rng"  # the iterator's Recorder, in its __dict__
EPOCH = "_sg_worker_epoch"  # how many fetchers each of its workers has made (or will have)
ENDED = "_sg_loader_ended"  # its loop ran it to StopIteration; cleared when it is reset
#: the states a restore set for its next epoch (`resume_ended`); cleared when that epoch begins
PENDING = "_sg_worker_pending"

#: set in the job while an iterator forks its workers; what those workers record into
_FORKING: Optional[tuple[int, "Recorder"]] = None
_tokens = itertools.count(1)
#: in a worker: its iterator's token -> how many fetchers it has made (its epoch)
_made: dict[int, int] = {}


class Recorder:
    """Three slots per worker in one shared anonymous mapping."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.memory = mmap.mmap(-1, workers * 3 * SLOT)  # MAP_SHARED: forked workers write here

    def _at(self, worker: int, slot: int) -> int:
        return (worker * 3 + slot) * SLOT

    def write(self, worker: int, slot: int, tag: int, payload: bytes) -> None:
        if len(payload) > SLOT - _HEADER.size:
            payload = b""  # too large to record: read back as missing
        at = self._at(worker, slot)
        seq = _HEADER.unpack_from(self.memory, at)[0]
        _HEADER.pack_into(self.memory, at, seq + 1, tag, 0)
        self.memory[at + _HEADER.size:at + _HEADER.size + len(payload)] = payload
        _HEADER.pack_into(self.memory, at, seq + 2, tag, len(payload))

    def read(self, worker: int, slot: int) -> tuple[int, bytes]:
        at = self._at(worker, slot)
        for _ in range(10_000):
            seq, tag, size = _HEADER.unpack_from(self.memory, at)
            if seq % 2 == 0:
                payload = bytes(self.memory[at + _HEADER.size:at + _HEADER.size + size])
                if _HEADER.unpack_from(self.memory, at)[0] == seq:
                    return tag, payload
            time.sleep(0.0001)
        return -1, b""

    def states(self, slot: int, epoch: int, wait_s: float = WAIT_S) -> Optional[list[bytes]]:
        """Every worker's states of ``slot`` tagged ``epoch``; None when a worker has none (it
        failed to record them, or its epoch did not start within ``wait_s``: a worker that died)."""
        deadline = time.monotonic() + wait_s
        out = []
        for worker in range(self.workers):
            while True:
                tag, payload = self.read(worker, slot)
                if tag == epoch and payload:
                    out.append(payload)
                    break
                if (tag == epoch and not payload) or tag > epoch or time.monotonic() > deadline:
                    return None  # the worker could not record them, or has gone on
                time.sleep(0.001)
        return out

    def override(self, states: list[bytes], epoch: int) -> None:
        """The workers start epoch ``epoch`` with ``states`` instead of their own generators."""
        for worker, payload in enumerate(states):
            self.write(worker, OVERRIDE, epoch, payload)


# --------------------------------------------------------------------------- in the workers
#: a worker's Dataset attributes of these types are recorded with its generators
_PLAIN = (int, float, str, bool, type(None))


def _dataset_state(dataset: Any) -> dict[str, Any]:
    """The attributes of the worker's own copy of the Dataset that its loading may change: plain
    values (a counter, the epoch it last saw: ``set_epoch`` in the job does not reach persistent
    workers) and random generators (``self.rng = np.random.default_rng(...)``, set in
    ``__init__`` or by a ``worker_init_fn``). A restore's new workers start from the job's copy,
    which has neither: the epoch after a restore drew other numbers, silently."""
    out: dict[str, Any] = {}
    np_random = sys.modules.get("numpy.random")
    generators: tuple = (random.Random,) + ((np_random.Generator, np_random.RandomState) if np_random else ())
    torch = sys.modules.get("torch")
    for name, value in list(getattr(dataset, "__dict__", {}).items()):
        if isinstance(value, str) and len(value) > 256:
            continue  # a text corpus read in __init__: data, not state (and too big for a slot)
        if type(value) in _PLAIN or isinstance(value, generators):
            out[name] = value
        elif torch is not None and isinstance(value, torch.Generator) and value.device.type == "cpu":
            out[name] = ("torch.Generator", value.get_state().numpy().tobytes())
    return out


def _capture(dataset: Any = None) -> bytes:
    """The worker's generators and its Dataset's state, pickled; empty when they cannot be read
    (read back as missing)."""
    try:
        import torch

        np_random = sys.modules.get("numpy.random")
        return pickle.dumps((torch.get_rng_state().numpy().tobytes(), random.getstate(),
                             np_random.get_state() if np_random is not None else None,
                             _dataset_state(dataset)),
                            protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - recording must never break the job's data loading
        return b""


def _apply(payload: bytes, dataset: Any = None) -> None:
    import torch

    t, py, np_state, *rest = pickle.loads(payload)
    torch.set_rng_state(torch.frombuffer(bytearray(t), dtype=torch.uint8))
    random.setstate(py)
    if np_state is not None:
        import numpy.random

        numpy.random.set_state(np_state)
    for name, value in (rest[0] if rest and dataset is not None else {}).items():
        if isinstance(value, tuple) and value[:1] == ("torch.Generator",):
            generator = getattr(dataset, name, None)
            if isinstance(generator, torch.Generator):
                generator.set_state(torch.frombuffer(bytearray(value[1]), dtype=torch.uint8))
            continue
        setattr(dataset, name, value)


def worker_made_fetcher(fetcher: Any) -> Any:
    """In a worker of a recorded iterator: an epoch starts. Put back the generators a restore
    asked for, record them, and record them again after every batch the fetcher loads."""
    if _FORKING is None:
        return fetcher
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:  # a single-process iterator of the job itself
        return fetcher
    token, recorder = _FORKING
    epoch = _made[token] = _made.get(token, 0) + 1
    worker = info.id
    tag, wanted = recorder.read(worker, OVERRIDE)
    if tag == epoch and wanted:
        _apply(wanted, info.dataset)
    now = _capture(info.dataset)
    recorder.write(worker, START, epoch, now)
    recorder.write(worker, LATEST, epoch, now)
    fetch = fetcher.fetch

    def recording_fetch(index: Any) -> Any:
        try:
            return fetch(index)
        finally:
            recorder.write(worker, LATEST, epoch, _capture(info.dataset))

    fetcher.fetch = recording_fetch
    return fetcher


# --------------------------------------------------------------------------- in the job
def forking(it: Any, loader: Any) -> Optional[tuple[int, Recorder]]:
    """What the workers ``it`` is about to fork should record into (persistent workers only)."""
    if not (getattr(loader, "persistent_workers", False) and loader.num_workers > 0):
        return None
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
    if method != "fork":  # the workers would not share the mapping
        return None
    recorder = Recorder(loader.num_workers)
    it.__dict__[ATTR] = recorder
    return next(_tokens), recorder


def recorder_of(it: Any) -> Optional[Recorder]:
    return getattr(it, "__dict__", {}).get(ATTR)


def states_of(it: Any, slot: int) -> Optional[list[bytes]]:
    """Every worker's states of ``slot`` in ``it``'s current epoch; None when its workers record
    none (spawned, or not persistent).

    Raises `CheckpointFailure` when they should have but did not within `WAIT_S`: saved without
    them, a restore would start new workers with other generators and differ silently."""
    recorder = recorder_of(it)
    if recorder is None:
        return None
    epoch = it.__dict__.get(EPOCH, 0)
    states = recorder.states(slot, epoch, WAIT_S)
    if states is None:
        raise CheckpointFailure(
            f"the {recorder.workers} workers of a DataLoader with persistent_workers=True did not record "
            f"their random generators for epoch {epoch} within {WAIT_S:g} s (a worker died or could not "
            f"pickle its generators): without them a restore would draw other random numbers in its "
            f"workers. This checkpoint is not taken; the next one tries again")
    return states


def saved_states(it: Any) -> Optional[tuple[str, list[bytes]]]:
    """What a checkpoint of ``it`` needs of its workers' generators: ``("inside", the epoch's start
    states)`` in the middle of an epoch (the restore replays the epoch from them), ``("ended",
    the latest states)`` once its loop has ended (the next ``iter(loader)`` begins an epoch from
    them; None for spawned workers, and an ended iterator is not replayed even then); None for
    workers that do not persist or were spawned."""
    if not getattr(it, "_persistent_workers", False):
        return None  # its workers start afresh each epoch: a replay of the epoch reproduces them
    if it.__dict__.get(ENDED):
        pending = it.__dict__.get(PENDING)
        return "ended", pending if pending is not None else states_of(it, LATEST)
    states = states_of(it, START)
    return ("inside", states) if states is not None else None


def resume_ended(it: Any, states: Optional[list[bytes]]) -> None:
    """A restored iterator whose loop had ended: its workers begin the next epoch with ``states``.

    Until that epoch begins, a checkpoint carries ``states`` again. The workers' own ``latest``
    states are not the ones to carry: they come from the batches the iterator's creation sent
    them, which it drops, and a checkpoint could read them before the workers had loaded those."""
    recorder = recorder_of(it)
    if recorder is not None and states:
        recorder.override(states, it.__dict__[EPOCH] + 1)
        it.__dict__[PENDING] = states
    it.__dict__[ENDED] = True


def install(data_module: Any) -> None:
    """Patch ``torch.utils.data``: multi-process iterators make a Recorder before forking their
    workers and count their epochs; workers record through their fetchers (`worker_made_fetcher`)."""
    dataloader = data_module.dataloader
    iter_cls = dataloader._MultiProcessingDataLoaderIter
    kind_cls = dataloader._DatasetKind
    if getattr(iter_cls.__init__, "_sg_patched", False):
        return
    original_init, original_reset, original_next = iter_cls.__init__, iter_cls._reset, iter_cls._next_data
    original_create = kind_cls.create_fetcher

    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        global _FORKING
        _FORKING = forking(self, loader)
        try:
            original_init(self, loader, *args, **kwargs)
        finally:
            _FORKING = None

    def _reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        original_reset(self, loader, first_iter)
        self.__dict__[EPOCH] = 1 if first_iter else self.__dict__.get(EPOCH, 0) + 1
        self.__dict__.pop(ENDED, None)
        self.__dict__.pop(PENDING, None)

    def _next_data(self: Any) -> Any:
        try:
            return original_next(self)
        except StopIteration:
            self.__dict__[ENDED] = True
            raise

    def create_fetcher(*args: Any, **kwargs: Any) -> Any:
        return worker_made_fetcher(original_create(*args, **kwargs))

    __init__._sg_patched = True  # type: ignore[attr-defined]
    iter_cls.__init__, iter_cls._reset, iter_cls._next_data = __init__, _reset, _next_data
    kind_cls.create_fetcher = staticmethod(create_fetcher)
