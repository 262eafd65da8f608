"""Tracebacks after a restore: the script's functions come back from the checkpoint, and their
code must keep its file name (cloudpickle names every code object ``<dynamic-code>``), or a
traceback the job prints shows frames without their source lines, and ``co_filename`` is not
``__file__``: output that differs from the uninterrupted run's (red-team round 7)."""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

PRINTS_TRACEBACKS = """
import sys, time, traceback

def check(step):
    if step % 3 == 2:
        raise ValueError(f"bad batch {step}")
    return step

def main():
    for step in range(9):
        try:
            check(step)
        except ValueError:
            traceback.print_exc(file=sys.stdout)
            frames = traceback.extract_tb(sys.exc_info()[2])
            print([(f.name, f.line, f.filename == __file__) for f in frames])
        print("step", step, check.__code__.co_filename == __file__)

main()
"""


def test_tracebacks_printed_after_a_restore_show_the_scripts_lines(launcher, tmp_path):
    (tmp_path / "tb.py").write_text(textwrap.dedent(PRINTS_TRACEBACKS))
    target = [str(tmp_path / "tb.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    assert 'raise ValueError(f"bad batch {step}")' in base.stdout
    out, _ = run_chain(launcher, target, pick_stops(trace, 4, extra=2), tmp_path / "ck")
    assert out == base.stdout
