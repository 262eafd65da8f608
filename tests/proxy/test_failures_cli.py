"""Failure paths through the CLI: unsaveable state, kill -9 mid-write, corrupted checkpoints."""
from __future__ import annotations

import os
import signal
import time

import pytest

from harness import SCRIPTS, run_chain, trace_of

SLEEP_HOOK = "SINGULARITY_PROXY_TEST_SLEEP_IN_WRITE"


def _loop_steps(trace, line):
    return [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == line]


def test_unsaveable_variables_fail_the_checkpoint_but_not_the_program(launcher, tmp_path):
    target = [str(SCRIPTS / "unsaveable.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    phase1 = _loop_steps(trace, 17)
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck1"), "--stop-at-step", str(phase1[2])])
    assert run.rc == 0, run.describe()
    assert run.stdout == base.stdout
    failed = [d for _, d in run.events("checkpoint_failed")]
    assert len(failed) == 1 and not run.events("checkpointed")
    assert ["sock", "socket"] in failed[0]["variables"]
    assert ["numbers", "generator"] in failed[0]["variables"]
    assert "line 17" in failed[0]["error"] and "`sock`" in failed[0]["error"]
    assert not list((tmp_path / "ck1").glob("ckpt-*"))


def test_unpicklable_thread_pool_is_rebuilt_by_rerunning_its_statement(launcher, tmp_path):
    target = [str(SCRIPTS / "unsaveable.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    stop = _loop_steps(trace, 26)[3]
    out, runs = run_chain(launcher, target, [stop], tmp_path / "ck")
    assert out == base.stdout
    done = [d for _, d in runs[0].events("checkpointed")]
    assert done and done[0]["rebuilt"] == ["pool"]


def test_a_logging_handler_that_cannot_be_saved_is_left_out_of_every_checkpoint(launcher, tmp_path):
    # the settings are saved unprobed while they pickle: the first save fails on the handler and
    # is taken again with each handler probed, as are the checkpoints after it
    target = [str(SCRIPTS / "unsaveable_settings.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    stops = _loop_steps(trace, 26)[2:6:3]
    out, runs = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout
    for run in runs[:-1]:
        assert run.events("checkpointed") and not run.events("checkpoint_failed"), run.describe()
    # only the first process has the handler: a restored one has the handlers a new process has
    assert "of logger 'remote' cannot be saved" in runs[0].stderr
    # probing from then on: the periodic checkpoints of one process all leave it out, none fails
    # a checkpoint in flight holds the next one back, so the steps last long enough for several
    periodic = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck-every"), "--checkpoint-every", "0.01"],
                            env={"STEP_SECONDS": "0.4"})
    assert periodic.rc == 0 and periodic.stdout == base.stdout, periodic.describe()
    assert len(periodic.events("checkpointed")) >= 3 and not periodic.events("checkpoint_failed")
    assert periodic.stderr.count("of logger 'remote' cannot be saved") == 1


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(launcher, tmp_path):
    target = [str(SCRIPTS / "misc.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    first, second = loops[3], loops[-5]
    ck = tmp_path / "ck"
    a = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(first)])
    assert a.rc == 75, a.describe()
    handle = launcher.start(target + ["--checkpoint-dir", str(ck), "--restore", "--stop-at-step", str(second)],
                            env={SLEEP_HOOK: "60"})
    deadline = time.monotonic() + 60
    while "test hook: sleeping" not in handle.stderr_so_far():
        assert time.monotonic() < deadline, handle.stderr_so_far()
        time.sleep(0.02)
    os.kill(handle.pid, signal.SIGKILL)
    killed = handle.wait()
    assert killed.rc == -signal.SIGKILL
    assert sorted(p.name for p in ck.iterdir()) == [f".ckpt-{second:08d}.tmp", f"ckpt-{first:08d}"]
    c = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
    assert c.rc == 0, c.describe()
    assert [d["step"] for _, d in c.events("restore")] == [first]
    assert (a.stdout + c.stdout).splitlines() == base.stdout.splitlines()


def test_corrupted_checkpoint_is_skipped_with_a_clear_message(launcher, tmp_path):
    target = [str(SCRIPTS / "misc.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    first, second = loops[5], loops[-8]
    ck = tmp_path / "ck"
    out, _ = run_chain(launcher, target, [first], ck)  # warm-up: proves the pair works
    assert out == base.stdout
    a = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(first)])
    b = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore", "--stop-at-step", str(second)])
    assert (a.rc, b.rc) == (75, 75), b.describe()
    damaged = ck / f"ckpt-{second:08d}" / "rank-0.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    c = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
    assert c.rc == 0, c.describe()
    assert f"ckpt-{second:08d} is damaged and was skipped" in c.stderr
    assert "digest" in c.stderr
    # the newest was picked, found damaged while it was read, and the one before it restored
    assert [d["step"] for _, d in c.events("restore")] == [second]
    assert [d["step"] for _, d in c.events("resumed")] == [first]
    assert (a.stdout + c.stdout).splitlines() == base.stdout.splitlines()


def test_periodic_checkpoints_are_pruned_and_resumable(launcher, tmp_path):
    # A paced loop: 30 iterations of 20 ms with a checkpoint due every 50 ms gives about a dozen
    # checkpoints whatever the machine's load (a loop without pauses could finish before two).
    script = tmp_path / "paced.py"
    script.write_text("import random, time\nrandom.seed(1)\nfor i in range(30):\n"
                      "    print(i, random.random(), flush=True)\n    time.sleep(0.02)\n")
    target = [str(script)]
    ck = tmp_path / "ck"
    base = launcher.run(target + ["--checkpoint-dir", str(ck), "--checkpoint-every", "0.05",
                                  "--keep-checkpoints"])
    assert base.rc == 0, base.describe()
    written = [d for _, d in base.events("checkpointed")]
    assert len(written) >= 3
    assert sorted(p.name for p in ck.glob("ckpt-*")) == [f"ckpt-{d['step']:08d}" for d in written[-2:]]
    resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
    assert resumed.rc == 0, resumed.describe()
    assert [d["step"] for _, d in resumed.events("restore")] == [written[-1]["step"]]
    assert base.stdout.endswith(resumed.stdout)


REENTERED_WITHS = """
import contextlib, os, tempfile, torch

def main():
    torch.manual_seed(0)
    path = os.path.join(os.path.dirname(__file__), "stack.log")
    with contextlib.ExitStack() as stack:
        stack.callback(print, "cleanup ran")
        log = stack.enter_context(open(path, "w"))
        for i in range(3):
            print("stack", i)
            print("logged", i, file=log)
    print(repr(open(path).read()))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(3):
            torch.save(torch.ones(2) * i, f"{tmp}/epoch{i}.pt")
            print("tmp", i, sorted(os.listdir(tmp)), torch.load(f"{tmp}/epoch0.pt").tolist())
    print("removed", os.path.exists(tmp))
    for epoch in range(2):
        noise = torch.rand(1).item()
        with torch.random.fork_rng():
            torch.manual_seed(123)
            for b in range(3):
                print("eval", epoch, b, torch.rand(1).item())
        print("train", epoch, noise)
    for i in range(2):
        print("after", i)

main()
"""


def test_with_statements_a_restore_enters_again_resume_inside(launcher, tmp_path):
    """With statements a restore enters again, once refused: a TemporaryDirectory (the stop's
    exit removed it; now held across stops and saved with its files), torch.random.fork_rng
    (until a checkpoint recorded the generators it found) and an ExitStack (until it was held
    across stops, with its callbacks and the file it holds) resume inside: the chains equal
    the run."""
    script = tmp_path / "withs.py"
    script.write_text(REENTERED_WITHS)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    lines = REENTERED_WITHS.splitlines()

    def line_of(text: str) -> int:
        return next(i for i, x in enumerate(lines, 1) if text in x)

    def loop_steps(body_text: str) -> list[int]:
        """The safe points of the for loop whose body holds ``body_text``."""
        line = max(i for i, x in enumerate(lines[:line_of(body_text)], 1) if x.strip().startswith("for "))
        return [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == line]

    assert "removed False" in base.stdout
    out, _ = run_chain(launcher, [str(script)], loop_steps("print(\"tmp\"")[1:], tmp_path / "ck-tmp")
    assert out == base.stdout
    out, _ = run_chain(launcher, [str(script)], loop_steps("print(\"after\"")[1:], tmp_path / "ck-after")
    assert out == base.stdout
    assert "'logged 0\\nlogged 1\\nlogged 2\\n'\ncleanup ran\n" not in base.stdout  # closed, then read
    assert "cleanup ran\n'logged 0\\nlogged 1\\nlogged 2\\n'" in base.stdout
    out, _ = run_chain(launcher, [str(script)], loop_steps("print(\"stack\"")[1:], tmp_path / "ck-stack")
    assert out == base.stdout
    out, _ = run_chain(launcher, [str(script)], loop_steps("print(\"eval\"")[1::2], tmp_path / "ck-fork")
    assert out == base.stdout


THREAD_AND_CSV = '''
import _csv, os, queue, threading

class Prefetcher:
    def __init__(self, items):
        self.items = items
        self.q = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()
    def _work(self):
        for x in self.items:
            self.q.put(x)
        self.q.put(None)
    def __iter__(self):
        while (x := self.q.get()) is not None:
            yield x

path = os.path.join(os.path.dirname(__file__), "d.csv")
with open(path, "w") as f:
    f.write("a,b\\n1,2\\n")
f = open(path)
reader = _csv.reader(f)  # the C reader itself, as a library that bound it before the job ran holds it
header = next(reader)
rows = [r for r in reader]
f.close()
for i in range(3):
    print("rows", i, rows)
del reader
for x in Prefetcher(range(6)):
    print("item", x)
'''


def test_a_running_thread_and_a_csv_reader_are_refused_with_advice_that_fits(launcher, tmp_path):
    """Both were refused before with advice that did not fit (``close it``; ``give Prefetcher
    __getstate__ ... leave out `_waiters` ``, the iterable named ``dict``). (``csv.reader`` in the
    program makes a reader that is saved, test_csv_readers.py; the C one is still refused.)"""
    script = tmp_path / "prefetch.py"
    script.write_text(THREAD_AND_CSV)
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    loops = sorted({t["line"] for t in trace if t["kind"] == "loop"})
    for line, expected in [(loops[0], ["`reader` is a csv reader", "rows = list(csv.reader(f))"]),
                           (loops[1], ["`<iterable of the loop at line", "its local `self` (Prefetcher)",
                                       "is a running thread (Prefetcher._work)", "num_workers=2"])]:
        step = _loop_steps(trace, line)[1]
        run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / f"ck{step}"), "--stop-at-step", str(step)])
        assert run.rc == 0 and run.stdout == base.stdout, run.describe()
        failed = [d["error"] for _, d in run.events("checkpoint_failed")]
        assert len(failed) == 1 and all(e in failed[0] for e in expected), failed
        assert "dict" not in failed[0] and "close it" not in failed[0], failed


THREAD_FEEDING_A_QUEUE = """
import queue, threading

def producer(q, n):
    for i in range(n):
        q.put(i * i)
    q.put(None)

q = queue.Queue(maxsize=2)
t = threading.Thread(target=producer, args=(q, 8), daemon=True)
t.start()
step = 0
while (item := q.get()) is not None:
    print("step", step, item)
    step += 1
"""


def test_a_running_thread_in_a_variable_is_refused_not_made_again_unstarted(launcher, tmp_path):
    """``t = threading.Thread(...); t.start()`` at the top level: a checkpoint while it runs
    re-created it from its statement, unstarted, so a restore would wait forever for what it no
    longer puts in the queue (or, with the queue full, the advice was about ``q.not_full._waiters``)."""
    script = tmp_path / "producer.py"
    script.write_text(THREAD_FEEDING_A_QUEUE)
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    step = [t["step"] for t in trace if t["kind"] == "loop"][2]
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert run.rc == 0 and run.stdout == base.stdout, run.describe()
    failed = [d for _, d in run.events("checkpoint_failed")]
    assert len(failed) == 1 and "`t` is a running thread (producer)" in failed[0]["error"], failed
    assert "t" in [v[0] for v in failed[0]["variables"]], failed
    if "q" in [v[0] for v in failed[0]["variables"]]:  # the queue's own advice, not `__getstate__` for Queue
        assert "`q` is a queue.Queue between threads" in failed[0]["error"] and "give Queue" not in failed[0]["error"]


RECURSIVE = """
import time

def descend(depth):
    if depth == 6:
        return 0
    for k in range(2):
        print(depth, k)
        time.sleep(0.1)
    return 1 + descend(depth + 1)

print("depth", descend(0))
"""

@pytest.mark.parametrize("when", ["before it starts", "while it runs"])
def test_a_request_to_a_program_without_safe_points_is_answered(tmp_path, when):
    """A stop asked for while a program without safe points was being loaded (a lambda submitted
    as the callable) was never answered; one asked for while it runs is answered at once."""
    from backend.proxy import CheckpointStore, Controller, ResumableProgram

    events = []
    ctl = Controller(CheckpointStore(tmp_path / "ck"), on_event=lambda t, d: events.append((t, d)))
    program = ResumableProgram.from_callable(lambda n: __import__("time").sleep(n) or n, (0.3,))
    assert not program.has_safe_points
    if when == "before it starts":
        ctl.request_checkpoint("stop", "preempt")
    else:
        import threading

        threading.Timer(0.1, ctl.request_checkpoint, kwargs={"then": "stop", "reason": "preempt"}).start()
    with pytest.warns(RuntimeWarning, match="runs without safe points"):
        assert program.run({}, ctl) == 0.3
    failed = [d["error"] for t, d in events if t == "checkpoint_failed"]
    assert len(failed) == 1 and "has no safe points" in failed[0], events


def test_a_stop_asked_for_inside_recursion_is_answered_when_the_program_ends(launcher, tmp_path):
    """Loops in a recursive call have no safe points: the request waited, and the program ended
    without a word to the caller about it."""
    script = tmp_path / "job.py"
    script.write_text(RECURSIVE)
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-after-seconds", "0.35"])
    assert run.rc == 0, run.describe()
    failed = [d["error"] for _, d in run.events("checkpoint_failed")]
    assert len(failed) == 1 and "ended before a safe point" in failed[0], run.describe()


ASYNC_LOOP = """
import asyncio, time

async def main():
    total = 0
    for step in range(30):
        await asyncio.sleep(0)
        total += step
        time.sleep(0.03)
    return total

print(asyncio.run(main()))
"""


def test_a_request_a_loop_in_an_async_function_never_reached_says_so(launcher, tmp_path):
    """The answer used to speak of recursive calls only; it now names the loop and why its
    function has no safe point."""
    script = tmp_path / "fetch.py"
    script.write_text(ASYNC_LOOP)
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-after-seconds", "0.3"])
    assert run.rc == 0 and run.stdout == "435\n", run.describe()
    [failed] = [d["error"] for _, d in run.events("checkpoint_failed")]
    assert "the loops at line(s) 6 (in main: async functions run unchanged) have none" in failed, failed


def test_a_program_exiting_with_the_stop_status_exits_1_saying_why(launcher, tmp_path):
    """75 is what a run stopped at a checkpoint exits with: a program's own ``sys.exit(75)``
    read as a stop (run again with --restore: the program ran again from its start)."""
    script = tmp_path / "tempfail.py"
    script.write_text("import sys\nprint('done')\nsys.exit(75)\n")
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck")])
    assert run.rc == 1 and run.stdout == "done\n", run.describe()
    assert "exited with status 75, which means a stop at a checkpoint here" in run.stderr


def test_sys_exit_with_a_message_prints_it_as_python_does(launcher, tmp_path):
    script = tmp_path / "message.py"
    script.write_text("import sys\nsys.exit('failed: acc=30')\n")
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck")])
    assert run.rc == 1 and "failed: acc=30" in run.stderr, run.describe()
