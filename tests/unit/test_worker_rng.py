"""The shared slots persistent DataLoader workers record their generators in (worker_rng.py)."""
import os

from backend.proxy.engine import worker_rng
from backend.proxy.engine.worker_rng import LATEST, OVERRIDE, START, Recorder


def test_a_forked_process_writes_what_the_parent_reads():
    recorder = Recorder(2)
    recorder.override([b"put back", b"also"], epoch=2)
    pid = os.fork()
    if pid == 0:  # a worker: it reads the override meant for its second epoch and records
        code = 0
        try:
            tag, wanted = recorder.read(1, OVERRIDE)
            code = 0 if (tag, wanted) == (2, b"also") else 3
            recorder.write(0, START, 2, b"zero")
            recorder.write(1, START, 2, b"one")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert recorder.states(START, 2) == [b"zero", b"one"]


def test_missing_or_stale_states_are_none_without_waiting_long():
    recorder = Recorder(2)
    recorder.write(0, LATEST, 1, b"state")
    recorder.write(1, LATEST, 1, b"")  # the worker could not read its generators
    assert recorder.states(LATEST, 1) is None
    recorder.write(1, LATEST, 3, b"later")  # that worker has gone on to another epoch
    assert recorder.states(LATEST, 1) is None
    assert recorder.states(START, 1, wait_s=0.05) is None  # nothing written


def test_a_state_too_large_for_its_slot_reads_as_missing():
    recorder = Recorder(1)
    recorder.write(0, START, 1, b"x" * worker_rng.SLOT)
    assert recorder.states(START, 1) is None


def test_captured_generators_put_back_give_the_same_draws():
    import random

    import numpy as np
    import numpy.random  # loaded before the capture, as in a worker (torch seeds it there)
    import torch

    saved = worker_rng._capture()
    first = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    worker_rng._apply(saved)
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == first


class _Iterator:
    """What `saved_states` reads of a persistent-workers DataLoader iterator."""
    _persistent_workers = True


def test_a_checkpoint_without_the_workers_states_is_refused_not_taken_silently(monkeypatch):
    import pytest

    from backend.proxy.checkpoint.errors import CheckpointFailure

    monkeypatch.setattr(worker_rng, "WAIT_S", 0.05)
    it = _Iterator()
    recorder = it.__dict__[worker_rng.ATTR] = Recorder(2)
    it.__dict__[worker_rng.EPOCH] = 2
    recorder.write(0, START, 2, b"zero")  # worker 1 is still loading the batches sent before epoch 2
    with pytest.raises(CheckpointFailure, match="did not record their random generators for epoch 2"):
        worker_rng.saved_states(it)
    recorder.write(1, START, 2, b"one")
    assert worker_rng.saved_states(it) == ("inside", [b"zero", b"one"])
    it.__dict__[worker_rng.ENDED] = True
    with pytest.raises(CheckpointFailure):
        worker_rng.saved_states(it)  # its loop ended, and no worker recorded its latest states
    it.__dict__[worker_rng.PENDING] = [b"set", b"by a restore"]
    assert worker_rng.saved_states(it) == ("ended", [b"set", b"by a restore"])


def test_spawned_workers_record_nothing_and_an_ended_iterator_stays_ended():
    it = _Iterator()
    assert worker_rng.saved_states(it) is None
    it.__dict__[worker_rng.ENDED] = True
    assert worker_rng.saved_states(it) == ("ended", None)
