"""Process-wide settings the statements before a safe point made: recorded by a checkpoint and
put back in a process that starts with the libraries' defaults."""
from __future__ import annotations

import io
import logging
import pickle
import socket
import sys
import warnings

import numpy as np
import pytest
import torch

from backend.proxy.engine import context, process_settings
from backend.proxy.engine.state import ProxyPickler, probe


def checkpoint() -> bytes:
    buf = io.BytesIO()
    ProxyPickler(buf, protocol=4).dump(process_settings.capture(probe))
    return buf.getvalue()


def saved_now() -> dict:
    return pickle.loads(checkpoint())


@pytest.fixture()
def clean_process(tmp_path, monkeypatch):
    """Undo every setting the test makes, as a fresh process would not have them."""
    monkeypatch.chdir(tmp_path)
    context.begin()
    process_settings.begin()
    before = saved_now()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with warnings.catch_warnings():
        yield tmp_path
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    before["logging"] = {"disable": logging.NOTSET, "loggers": {}}
    process_settings.apply(before)
    logging.getLogger("train").handlers.clear()
    logging.getLogger("train").setLevel(logging.NOTSET)


def test_torch_and_numpy_settings_come_back(clean_process):
    torch.set_default_dtype(torch.float64)
    torch.set_printoptions(precision=10)
    torch.set_float32_matmul_precision("medium")
    np.set_printoptions(precision=2)
    np.seterr(divide="raise")
    saved = saved_now()

    torch.set_default_dtype(torch.float32)  # what a new process starts with
    torch.set_printoptions(profile="default")
    torch.set_float32_matmul_precision("highest")
    np.set_printoptions(precision=8)
    np.seterr(divide="warn")
    process_settings.apply(saved)
    assert (torch.ones(1) / 3).dtype == torch.float64
    assert repr(torch.tensor([1 / 3])) == "tensor([0.3333333333])"
    assert torch.get_float32_matmul_precision() == "medium"
    assert repr(np.array([1 / 3])) == "array([0.33])"
    with pytest.raises(FloatingPointError):
        np.array([1.0]) / 0


def test_a_log_file_keeps_its_lines_and_its_handler(clean_process):
    logging.basicConfig(filename="train.log", filemode="w", level=logging.INFO, format="%(message)s", force=True)
    log = logging.getLogger("train")
    log.info("before the checkpoint")
    saved = checkpoint()
    log.info("after the checkpoint: not in the resumed run")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.WARNING)  # a new process's logging

    process_settings.apply(pickle.loads(saved))  # the new process loads the checkpoint
    log.info("after the restore")
    logging.getLogger().handlers[0].flush()
    assert (clean_process / "train.log").read_text() == "before the checkpoint\nafter the restore\n"


def test_a_warning_filter_comes_back(clean_process):
    warnings.simplefilter("error", UserWarning)
    saved = saved_now()
    warnings.resetwarnings()
    process_settings.apply(saved)
    with pytest.raises(UserWarning):
        warnings.warn("now an error", UserWarning)


def test_a_handler_that_cannot_be_saved_is_named_and_left_out(clean_process):
    a, b = socket.socketpair()
    handler, fine = logging.StreamHandler(a.makefile("w")), logging.NullHandler()
    logging.getLogger("train").addHandler(handler)
    logging.getLogger("metrics").addHandler(fine)  # probed with it, but saved: only 'train' loses its handler
    try:
        with pytest.warns(RuntimeWarning, match="logging handler .* of logger 'train' cannot be saved"):
            saved = saved_now()
        assert saved["logging"]["loggers"]["train"]["handlers"] is None
        assert [type(h) for h in saved["logging"]["loggers"]["metrics"]["handlers"]] == [logging.NullHandler]
    finally:
        logging.getLogger("train").removeHandler(handler)
        logging.getLogger("metrics").removeHandler(fine)
        a.close(), b.close()


class Tee:
    def __init__(self, terminal, copy):
        self.terminal, self.copy = terminal, copy

    def write(self, text):
        self.copy.append(text)
        return self.terminal.write(text)


def test_a_replaced_stdout_comes_back_wrapping_the_new_process_stdout(clean_process, monkeypatch):
    started = sys.stdout
    monkeypatch.setattr(sys, "stdout", Tee(started, ["before\n"]))
    saved = checkpoint()
    sys.stdout = started  # a new process: its own stdout, as the program began
    process_settings.apply(pickle.loads(saved))
    tee = sys.stdout
    assert isinstance(tee, Tee) and tee.terminal is started and tee.copy == ["before\n"]
