"""``functools.lru_cache``/``functools.cache`` on the program's functions: a checkpoint saves their
entries, order and counters, so a restore neither crashes (CPython's wrapper pickles as a name
the loading namespace does not hold yet) nor recomputes an entry that drew random numbers or
was mutated since. Behaviour, printed ``cache_info()`` included, is plain Python's."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from harness import pick_stops, run_chain, trace_of

HELPERS = """
import functools
import random

@functools.lru_cache(maxsize=None)
def noise(seed):
    return random.random() + seed     # a global draw: recomputing it would differ
"""

CACHED = """
import functools
import random
from functools import cache, lru_cache

from helpers import noise

random.seed(4)

@lru_cache
def table(n):
    return [random.random() for _ in range(n)]

@functools.lru_cache(maxsize=2)
def square(x, scale=1):
    print("computing", x, scale)
    return x * x * scale

@cache
def shared():
    return {"calls": 0}               # mutated through the cache by the loop

class Model:
    @functools.cache
    def width(self, k):
        return k * 3
    def __hash__(self):
        return 1
    def __eq__(self, other):
        return isinstance(other, Model)

def main():
    m = Model()
    for step in range(9):
        shared()["calls"] += 1
        print(step, table(3)[step % 3], square(step % 3), square(2, scale=step % 2),
              shared()["calls"], m.width(step % 2), noise(step % 2), square.cache_info())
    print(table.cache_info(), shared.cache_info(), noise.cache_info(), square.cache_parameters())

main()
"""


def test_cached_functions_resume_with_their_entries_and_counters(launcher, tmp_path):
    (tmp_path / "helpers.py").write_text(textwrap.dedent(HELPERS))
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(CACHED))
    target = [str(script)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout == plain.stdout  # the Python cache behaves as CPython's
    stops = pick_stops(trace, 1, extra=4)
    out, _ = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout, f"stops {stops}"
