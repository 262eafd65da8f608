"""The ``__del__`` of a script's globals runs at the program's real end, as when the interpreter
clears ``__main__`` at exit: after its atexit handlers, with the builtins as they were at start,
and not in a process that stopped for a preemption (which printed a summary of half a run). The
lines are compared with what ``python train.py`` prints."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import assert_chains_match, trace_of

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
