"""Objects that stand for something outside the process: a TensorBoard writer is re-opened on the
same log, a lock is re-created, and an object holding a socket is refused with advice that names
the attribute, never re-created from its statement (which would restart its progress)."""
from __future__ import annotations

import socket
import threading
import textwrap
from pathlib import Path

import pytest

from backend.proxy.engine import handles
from backend.proxy.engine.state import probe
from harness import EXIT_PREEMPTED, Launcher, assert_chains_match, pick_stops, run_chain, trace_of

pytest.importorskip("tensorboard", reason="the TensorBoard writer test needs the test extra (tensorboard)")

WRITER = """
import torch
from torch.utils.tensorboard import SummaryWriter

class Trainer:
    def __init__(self, logdir):
        self.writer = SummaryWriter(logdir, flush_secs=1)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

torch.manual_seed(0)
t = Trainer(LOGDIR)
x, y = torch.randn(16, 3), torch.randn(16, 1)
for step in range(10):
    t.opt.zero_grad()
    loss = torch.nn.functional.mse_loss(t.model(x), y)
    loss.backward()
    t.opt.step()
    t.writer.add_scalar("loss", loss.item(), step)
    print(step, loss.item().hex())
t.writer.close()
"""


def _scalars(logdir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        events += [(e.step, e.value) for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []
    return sorted(events)


@pytest.fixture(scope="module")
def launcher():
    lau = Launcher()
    yield lau
    lau.close()


@pytest.mark.parametrize("seed", [5, 17])
def test_summary_writer_is_reopened_on_the_same_log(launcher, tmp_path, seed):
    base_dir, chain_dir = tmp_path / "base-log", tmp_path / "chain-log"
    script = tmp_path / "job.py"
    script.write_text(WRITER.replace("LOGDIR", repr(str(base_dir))))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    script.write_text(WRITER.replace("LOGDIR", repr(str(chain_dir))))
    # the same program writing elsewhere: its safe points are the base run's
    stops = pick_stops(trace, seed, extra=2)
    out, runs = run_chain(launcher, [str(script)], stops, tmp_path / "ck")
    assert out == base.stdout
    assert _scalars(chain_dir) == _scalars(base_dir) and len(_scalars(base_dir)) == 10
    assert len(list(chain_dir.glob("events.out.tfevents.*"))) > 1  # re-opened, appended beside
    assert all(not d["rebuilt"] for r in runs for _, d in r.events("checkpointed"))


SOCKET_HOLDER = """
import socket
import threading

class Client:
    def __init__(self):
        self.sent = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

c = Client()
for i in range(4):
    c.sent += 1
    print(i, c.sent)
c.sock.close()
"""


def test_an_object_holding_a_socket_is_refused_with_advice_naming_the_attribute(launcher, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SOCKET_HOLDER))
    _, trace = trace_of(launcher, [str(script)], tmp_path)
    first_loop_step = next(t["step"] for t in trace if t["kind"] == "loop")
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step",
                        str(first_loop_step)])
    assert run.rc == 0, run.describe()  # refused: it runs on to the end instead of stopping
    assert run.stdout.splitlines()[-1] == "3 4"
    failed = [d for _, d in run.events("checkpoint_failed")]
    assert failed, run.describe()
    error = failed[0]["error"]
    assert "`c.sock` is a socket" in error and "__getstate__" in error, error
    assert ["c", "Client"] in failed[0]["variables"]


def test_progress_free_types_and_explanations():
    import threading

    sock = socket.socket()
    try:
        assert handles.progress_free(threading.Lock()) and not handles.progress_free(sock)
        assert "close it or `del s`" in handles.explain("s", sock, probe)
    finally:
        sock.close()
    assert "re-created on restore only when" in handles.explain("lock", threading.Lock(), probe)


def test_a_stop_request_on_refused_state_keeps_the_program_running(launcher, tmp_path):
    """The same socket holder with a stop requested at its loop's safe points: never a stop."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SOCKET_HOLDER))
    _, trace = trace_of(launcher, [str(script)], tmp_path)
    for step in [t["step"] for t in trace if t["kind"] == "loop"][::2]:
        run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / f"ck{step}"), "--stop-at-step", str(step)])
        assert run.rc != EXIT_PREEMPTED and run.rc == 0, run.describe()


def test_free_locks_and_events_are_saved_wherever_they_are(tmp_path):
    """A trainer holding a lock and an event (not progress-free as a whole, so never rebuilt)
    resumes exactly; a lock held at the safe point is refused, naming it."""
    from test_training_state import assert_exact_in_process

    src = """
import threading

class Trainer:
    def __init__(self):
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.seen = 0

    def fit(self, n):
        total = 0
        for i in range(n):
            with self.lock:
                self.seen += 1
                total += i * self.seen
            if i == 2:
                self.ready.set()
            print(i, total, self.ready.is_set(), self.lock.locked())
        return total

def main():
    guard = threading.RLock()
    t = Trainer()
    for epoch in range(2):
        with guard:
            pass
        print("epoch", epoch, t.fit(4))

main()
"""
    for seed in (3, 9):
        assert_exact_in_process(src, tmp_path / str(seed), seed, stops=3)
    lock = threading.Lock()
    with lock:
        assert "held at the safe point" in (probe(lock) or "")
    assert probe(lock) is None


def test_a_tqdm_bar_is_drawn_anew_with_its_count_settings_and_postfix():
    import io
    import pickle
    import sys

    from backend.proxy.engine.state import ProxyPickler

    tqdm = pytest.importorskip("tqdm").tqdm

    def round_trip(bar):
        buf = io.BytesIO()
        ProxyPickler(buf, protocol=4).dump(bar)
        bar.close()
        return pickle.loads(buf.getvalue())  # tqdm's own pickling would recurse forever here

    bar = tqdm(total=40, desc="epoch 2", unit="batch", file=sys.stdout, mininterval=5)
    bar.update(7)
    bar.set_postfix(loss=0.25)
    again = round_trip(bar)
    assert (again.n, again.total, again.desc, again.unit, again.postfix) == (7, 40, "epoch 2", "batch", "loss=0.25")
    assert again.fp._wrapped is sys.stdout and again.mininterval == 5
    again.close()
    quiet = round_trip(tqdm(range(3), disable=True))
    assert quiet.disable and list(quiet) == [0, 1, 2]


def test_a_generator_gets_advice_that_fits_the_code_at_hand():
    def forever(loader):
        while True:
            yield from loader

    advice = handles.explain("batches", forever([1, 2]), probe, top_level=False)
    assert "generator from forever()" in advice and "iter(loader)" in advice


def test_a_coroutine_driven_with_send_gets_advice_for_coroutines():
    def averager():
        total, count, avg = 0.0, 0, None
        while True:
            value = yield avg
            total += value
            count += 1
            avg = total / count

    avg = averager()
    next(avg)
    avg.send(1.0)
    advice = handles.explain("avg", avg, probe)
    assert "coroutine from averager()" in advice and "send(" in advice and "iter(loader)" not in advice


THREAD_LOCAL = """
import threading

tls = threading.local()  # a per-thread cache, as libraries keep a seed or a buffer pool
tls.seen = []

class Counter(threading.local):
    def __init__(self):
        self.calls = 0

def main():
    counter = Counter()
    for step in range(9):
        counter.calls += step
        tls.seen.append(step * step)
        print(step, counter.calls, sum(tls.seen), flush=True)

main()
"""


def test_a_thread_local_keeps_what_the_job_thread_put_in_it(launcher, tmp_path):
    """Re-running ``tls = threading.local()`` made it empty: the cache started over (or the next
    access raised AttributeError)."""
    script = tmp_path / "tls.py"
    script.write_text(THREAD_LOCAL)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.rc == 0 and "8 36 204" in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(4,), extra=2)


ENDED_POOLS = """
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
import torch

def square(x):
    return x * x

def main():
    with mp.Pool(2) as pool:
        a = pool.map(square, range(1, 5))
    with ThreadPoolExecutor(2) as threads:
        b = list(threads.map(square, a))
    with ProcessPoolExecutor(2) as processes:
        c = list(processes.map(square, range(3)))
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1e-4)
    for step in range(6):
        loss = (w * torch.tensor(a, dtype=torch.float32) - torch.tensor(b, dtype=torch.float32)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, loss.item().hex())
    for name, use in (("pool", lambda: pool.map(square, [1])), ("threads", lambda: threads.submit(square, 1)),
                      ("processes", lambda: processes.submit(square, 1))):
        try:
            use()
        except (ValueError, RuntimeError) as e:
            print(name, type(e).__name__, e)
    pool.join()
    threads.shutdown()
    processes.shutdown()
    print(c, repr(pool)[-30:])

main()
"""


def test_pools_and_executors_that_ended_before_the_loop_are_saved_as_ended(launcher, tmp_path):
    """``with Pool(2) as pool:`` (or an executor) for preprocessing before the loop leaves the name
    bound to an ended pool, which does not pickle: every checkpoint in the loop after it was
    refused. Saved as an ended pool without workers, it raises after a restore what it raised."""
    script = tmp_path / "pools.py"
    script.write_text(ENDED_POOLS)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert "pool ValueError Pool not running" in base.stdout, base.stdout
    assert base.stdout.count("cannot schedule new futures after shutdown") == 2, base.stdout
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(1, 2), extra=3)


def test_a_struct_format_is_made_again_from_its_format():
    """``record = struct.Struct("<id")`` before the loop: refused as unpicklable, so no stop could
    land in a loop that packs with it."""
    import io
    import pickle
    import struct

    from backend.proxy.engine.state import ProxyPickler

    buf = io.BytesIO()
    ProxyPickler(buf, protocol=4).dump({"record": struct.Struct("<id")})
    record = pickle.loads(buf.getvalue())["record"]
    assert record.format == "<id" and record.unpack(record.pack(3, 0.5)) == (3, 0.5)
