"""The ``__del__`` of a script's globals runs at the program's real end, as when the interpreter
clears ``__main__`` at exit: after its atexit handlers, with the builtins as they were at start,
and not in a process that stopped for a preemption (which printed a summary of half a run). The
lines are compared with what ``python train.py`` prints."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from harness import assert_chains_match, run_chain, trace_of

SUMMARY = """
import atexit, builtins

class Summary:
    def __init__(self):
        self.steps = []

    def __del__(self):
        print("summary:", len(self.steps), "steps", flush=True)

real_print = builtins.print
builtins.print = lambda *a, **k: real_print("[log]", *a, **k)
atexit.register(lambda: print("atexit first", flush=True))
summary = Summary()
_private = Summary()
for step in range(6):
    summary.steps.append(step)
    print(step, flush=True)
"""


def test_del_of_globals_runs_once_at_the_real_end(launcher, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SUMMARY))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.stdout.endswith("[log] 5\n[log] atexit first\nsummary: 6 steps\nsummary: 0 steps\n"), base.describe()
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout == base.stdout
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(6,), extra=2)


FINALIZERS = """
import weakref

class Resource:
    def __init__(self, name):
        self.name = name
        self._finalizer = weakref.finalize(self, print, "closed", name, flush=True)

def released(name, log):
    log.append(name)
    print("released", name, len(log), flush=True)

log = []
items = [Resource(f"r{i}") for i in range(4)]
for r in items:
    weakref.finalize(r, released, r.name, log)
for step in range(8):
    if step == 3:
        del items[0]
    if step == 5:
        items[1]._finalizer()
    print(step, [r.name for r in items], [r._finalizer.alive for r in items], flush=True)
"""


def test_weakref_finalizers_fire_as_in_a_plain_run(launcher, tmp_path):
    """A finalizer kept in an attribute came back dead, and one kept only by ``weakref``'s
    registry was lost: after a restore neither fired, when its object went or at exit."""
    script = tmp_path / "finalizers.py"
    script.write_text(textwrap.dedent(FINALIZERS))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout == base.stdout and "released r1 4\nclosed r3\nclosed r1\n" in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(3, 4))




LIBRARY_HANDLER = """
import atexit, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "env", "site-packages"))
import teardown_lib

class Summary:
    def __del__(self):
        print("summary", flush=True)

atexit.register(print, "the program's own handler of a builtin", flush=True)
summary = Summary()
for step in range(4):
    if step == 1:
        teardown_lib.start()
    print(step, flush=True)
"""

TEARDOWN_LIB = """
import atexit

def start():  # as torch does when a DataLoader makes its first persistent workers
    atexit.register(print, "a library's atexit handler", flush=True)
"""


def test_atexit_handlers_run_before_main_is_cleared_and_the_programs_survive_a_restore(launcher, tmp_path):
    """The interpreter runs every atexit handler before it clears ``__main__``. The engine cleared
    it first, so torch's shutdown of persistent DataLoader workers ran after the loader's
    iterator had been collected with its queues: their finalizers had stopped the feeder
    threads, the workers never heard they were done, and the exit waited 5 s per worker. And a
    handler the program registers is the program's even when its function is a builtin: a
    restore lost ``atexit.register(print, ...)``."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LIBRARY_HANDLER))
    lib = tmp_path / "env" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "teardown_lib.py").write_text(textwrap.dedent(TEARDOWN_LIB))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout.endswith("3\na library's atexit handler\nthe program's own handler of a builtin\n"
                                 "summary\n"), plain.stdout
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.stdout == plain.stdout and "cannot be saved" not in base.stderr, base.describe()
    # stopped before the library registers its handler (the restored run's library registers it
    # again), and anywhere for the program's own
    early = [t["step"] for t in trace if t["kind"] == "loop"][:1]
    out, runs = run_chain(launcher, [str(script)], early, tmp_path / "ck-early")
    assert out == plain.stdout, runs[-1].describe()


TORCH_EXITING = """
import torch
from torch.utils.data import _utils

class Loader:
    def __init__(self):
        self.utils = _utils

    def __del__(self):  # what a DataLoader iterator's __del__ asks before it waits for its workers
        print("interpreter exiting when __main__ is cleared:", self.utils.python_exit_status, flush=True)

loader = Loader()
for step in range(3):
    print(step, flush=True)
"""


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_main_is_cleared_after_the_atexit_handlers_of_libraries_imported_before_the_program(
        launcher, fresh_launcher, tmp_path, how):
    """torch, imported by the warm server before the program ran, marks the interpreter as
    exiting in an atexit handler; a DataLoader iterator's shutdown is a no-op once it is set. The
    engine cleared ``__main__`` before that handler ran, so the iterator of a loader with
    persistent workers shut them down through queues whose feeder threads its collection had
    already stopped, and the job's exit waited 5 s for each worker."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TORCH_EXITING))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout.endswith("cleared: True\n"), plain.stdout
    run = (launcher if how == "forked" else fresh_launcher).run([str(script), "--checkpoint-dir", str(tmp_path / "ck")])
    assert run.rc == 0 and run.stdout == plain.stdout, run.describe()


GLOBAL_IN_DEL = """
OUT = "results.txt"

class Summary:
    def __init__(self):
        self.steps = 0

    def __del__(self):
        print("summary of", self.steps, "steps written to", OUT, flush=True)

summary = Summary()
for step in range(4):
    summary.steps += 1
    print(step, flush=True)
"""


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_a_del_at_exit_reads_the_scripts_globals(launcher, fresh_launcher, tmp_path, how):
    """The interpreter collects ``__main__``'s dict with the objects only it holds, running their
    ``__del__`` while every global is there; the engine emptied the dict first, so a summary
    naming a global raised ``NameError`` at the job's end and its line was missing."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(GLOBAL_IN_DEL))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout.endswith("3\nsummary of 4 steps written to results.txt\n"), plain.stdout
    run = (launcher if how == "forked" else fresh_launcher)
    base, trace = trace_of(run, [str(script)], tmp_path)
    assert base.stdout == plain.stdout, base.describe()
    assert_chains_match(run, [str(script)], base, trace, tmp_path, seeds=(5,), extra=1)


@pytest.mark.parametrize("how", ["forked", "fresh"])
@pytest.mark.parametrize("write", ["behind", "in-line"])
def test_a_del_at_exit_reads_the_scripts_globals_after_running_checkpoints(launcher, fresh_launcher, tmp_path,
                                                                            how, write):
    """A checkpoint the job ran on from (periodic, ``singularityctl checkpoint``, a migration's
    source copy) left the engine's per-type memos holding the script's classes, and through
    their methods its globals: at exit the namespace was not collected, the fallback emptied it,
    and the summary raised ``NameError``."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(GLOBAL_IN_DEL).replace("print(step, flush=True)",
                                                             "print(step, flush=True)\n    time.sleep(0.3)")
                      .replace('OUT = "results.txt"', 'import time\nOUT = "results.txt"'))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    args = [str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0.05"]
    run = (launcher if how == "forked" else fresh_launcher).run(args + (["--write-in-line"] if write == "in-line" else []))
    assert run.rc == 0 and run.events("checkpointed"), run.describe()
    assert run.stdout == plain.stdout and "NameError" not in run.stderr, run.describe()


TEE = """
import os
import sys

class Tee:  # everything printed goes to the console and to a log file, fsynced at each flush
    def __init__(self, path):
        self.console, self.file = sys.stdout, open(path, "w")

    def write(self, msg):
        self.console.write(msg)
        self.file.write(msg)

    def flush(self):
        self.console.flush()
        self.file.flush()
        os.fsync(self.file.fileno())

sys.stdout = Tee(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.log"))
for epoch in range(6):
    print("epoch", epoch)
"""


def test_a_tee_of_the_programs_own_as_stdout_is_flushed_before_its_globals_go(launcher, tmp_path):
    """``sys.stdout = Tee(...)`` whose ``flush`` calls ``os.fsync``: the engine let go of
    ``__main__`` before the streams were flushed, so the flush found no ``os`` and the process
    ended with status 120 where plain Python ends with 0."""
    script = tmp_path / "tee.py"
    script.write_text(textwrap.dedent(TEE))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and (tmp_path / "train.log").read_text() == plain.stdout
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.stdout == plain.stdout and "Exception ignored" not in base.stderr, base.describe()
    assert (tmp_path / "train.log").read_text() == plain.stdout
    out, runs = run_chain(launcher, [str(script)], [t["step"] for t in trace if t["kind"] == "loop"][2:4],
                          tmp_path / "ck")
    assert out == plain.stdout and runs[-1].rc == 0, runs[-1].describe()


NEVER_CLOSED = """
import os, sys
import torch

def evaluate(w):                                 # any function: it holds the globals in a cycle
    return float((w ** 2).sum())

os.chdir(sys.argv[1])
log = open("train.log", "w")                     # opened at the top, never closed
acts = open("acts.bin", "wb")
w = torch.ones(3)
for epoch in range(4):
    w = w * 0.5
    log.write(f"epoch {epoch} {evaluate(w):.6f}\\n")
    acts.write(w.numpy().tobytes())
print("done")
"""


def test_files_left_open_are_flushed_at_the_end_as_in_a_plain_run(launcher, tmp_path):
    """A log opened at the top of a script and never closed: letting go of ``__main__``, the
    collector freed its raw file before its buffer and the log came out empty, with no stop at all."""
    script = tmp_path / "open.py"
    script.write_text(textwrap.dedent(NEVER_CLOSED))
    plain = tmp_path / "plain"
    plain.mkdir()
    subprocess.run([sys.executable, str(script), str(plain)], check=True, capture_output=True, timeout=60)
    expected = {name: (plain / name).read_bytes() for name in ("train.log", "acts.bin")}
    assert all(expected.values())
    engine = tmp_path / "engine"
    engine.mkdir()
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--", str(engine)])
    assert run.rc == 0, run.describe()
    assert {name: (engine / name).read_bytes() for name in expected} == expected
