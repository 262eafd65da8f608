"""The ``__del__`` of a script's globals runs at the program's real end, as when the interpreter
clears ``__main__`` at exit: after its atexit handlers, with the builtins as they were at start,
and not in a process that stopped for a preemption (which printed a summary of half a run). The
lines are compared with what ``python train.py`` prints."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import pick_stops, run_chain, trace_of

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
    stops = pick_stops(trace, 6, extra=2)
    out, runs = run_chain(launcher, [str(script)], stops, tmp_path / "ck")
    assert out == base.stdout, f"stops {stops}\n{runs[-1].describe()}"
