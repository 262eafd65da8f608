"""State two names share must stay shared after a restore: a numpy view and its base (a replay
buffer's ``self.obs = self.storage[:, :3]``), two closures of one factory (``update, get_best =
make_tracker()``). Both came back as independent copies before, and the run after a restore
differed silently (found by running realistic scripts at random stops)."""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

SHARED = """
import numpy as np

class Buffer:
    def __init__(self, n):
        self.storage = np.zeros((n, 4))
        self.obs = self.storage[:, :3]          # views: writes through them fill storage
        self.reward = self.storage[:, 3]
        self.size = 0
    def add(self, obs, r):
        self.obs[self.size] = obs
        self.reward[self.size] = r
        self.size += 1

def make_tracker():
    best = float("inf")
    def update(loss):
        nonlocal best
        best = min(best, loss)
    def get_best():
        return best
    return update, get_best

rng = np.random.default_rng(0)
buf = Buffer(12)
update, get_best = make_tracker()
col = buf.storage[:, 0]
for step in range(12):
    buf.add(rng.normal(size=3).round(3), step * 0.5)
    loss = (step - 7) ** 2 + 0.5
    update(loss)
    print(step, buf.storage.sum().round(6), col.sum().round(6), "best", get_best())
"""


def test_numpy_views_and_shared_closure_cells_stay_shared_after_restores(launcher, tmp_path):
    script = tmp_path / "shared.py"
    script.write_text(textwrap.dedent(SHARED))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    out, _ = run_chain(launcher, [str(script)], pick_stops(trace, 3, extra=3), tmp_path / "ck")
    assert out == base.stdout
