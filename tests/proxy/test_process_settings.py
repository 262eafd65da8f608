"""Process-wide settings the statements before a safe point made: recorded by a checkpoint and
put back in a process that starts with the libraries' defaults."""
from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import socket
import sys
import time
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


def test_warnings_captured_by_logging_still_go_to_the_log(clean_process):
    logging.captureWarnings(True)
    saved = saved_now()
    logging.captureWarnings(False)  # a new process shows warnings on stderr
    process_settings.apply(saved)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("py.warnings").addHandler(handler)
    try:
        warnings.simplefilter("always")
        warnings.warn("loss plateaued")
    finally:
        logging.getLogger("py.warnings").removeHandler(handler)
    assert warnings.showwarning is logging._showwarning  # type: ignore[attr-defined]
    assert [r for r in records if "UserWarning: loss plateaued" in r.getMessage()]


def test_the_umask_comes_back(clean_process):
    started = os.umask(0o077)
    try:
        saved = saved_now()
        os.umask(0o022)  # a new process's umask
        process_settings.apply(saved)
        (clean_process / "out.txt").write_text("x\n")
        assert (clean_process / "out.txt").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(started)


@pytest.fixture()
def tz_back():
    """Put the test process's TZ and the C library's zone back."""
    started = os.environ.get("TZ")
    yield
    if started is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = started
    time.tzset()


def local(seconds: float) -> str:
    return time.strftime("%H:%M %Z", time.localtime(seconds))


def test_a_time_zone_set_with_tzset_comes_back_after_the_environment(clean_process, tz_back):
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    assert local(1_700_000_000) == "03:43 IST"
    env, saved = context.capture(), saved_now()

    os.environ["TZ"] = "UTC"  # a new process: its zone from the service's environment
    time.tzset()
    context.restore(env)  # as program.run: the environment first (TZ, without tzset), then the settings
    process_settings.apply(saved)
    assert local(1_700_000_000) == "03:43 IST"


def test_a_tz_variable_set_without_tzset_leaves_the_zone_alone(clean_process, tz_back):
    os.environ["TZ"] = "UTC"
    time.tzset()
    process_settings.begin()
    os.environ["TZ"] = "Asia/Kolkata"  # no time.tzset(): localtime still uses UTC
    saved = saved_now()
    assert saved["zone"] is None
    process_settings.apply(saved)
    assert local(1_700_000_000) == "22:13 UTC"


usr1: list[int] = []


def on_usr1(signum, frame) -> None:
    usr1.append(signum)


class Connected:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def on_signal(self, signum, frame) -> None:
        pass


@pytest.fixture()
def signals_back():
    started = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)}
    yield
    for sig, handler in started.items():
        signal.signal(sig, handler)


def test_a_signal_handler_of_the_job_comes_back(clean_process, signals_back):
    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    saved = saved_now()
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # a new process: the default action ends it
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    process_settings.apply(saved)
    assert signal.getsignal(signal.SIGUSR1) is on_usr1 and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    usr1.clear()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1 == [signal.SIGUSR1]
    # the next checkpoint saves it again, though this process had it when apply began
    assert saved_now()["signals"][signal.SIGUSR1] is on_usr1


def test_the_host_s_signal_handlers_are_not_saved_and_one_that_cannot_be_is_named(clean_process, signals_back):
    signal.signal(signal.SIGUSR1, on_usr1)  # the host's (the worker's SIGTERM handler), before the program
    process_settings.begin()
    a, b = socket.socketpair()
    signal.signal(signal.SIGUSR2, Connected(a).on_signal)
    try:
        with pytest.warns(RuntimeWarning, match="handler .* of signal SIGUSR2 cannot be saved"):
            saved = saved_now()
    finally:
        a.close(), b.close()
    assert signal.SIGUSR1 not in saved["signals"] and signal.SIGUSR2 not in saved["signals"]


def test_a_handler_the_host_changes_while_the_program_runs_is_not_the_job_s(clean_process, signals_back):
    signal.signal(signal.SIGUSR1, on_usr1)  # the worker's SIGTERM handler: the host's, before the program
    process_settings.begin()
    process_settings.host_sets_signal(signal.SIGUSR1, signal.SIG_DFL)  # on the notice: a second one ends it
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert signal.SIGUSR1 not in saved_now()["signals"]  # else a restored job would die on its next notice
