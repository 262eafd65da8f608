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


def _round_trip(state: dict) -> dict:
    import io
    import pickle

    from backend.proxy.engine.state import ProxyPickler

    buf = io.BytesIO()
    ProxyPickler(buf, protocol=4).dump(state)
    return pickle.loads(buf.getvalue())


def test_a_small_view_met_before_its_large_base_stays_a_view_of_it():
    """``head = big[:4]`` pickled before ``big`` (a name bound earlier, a dict's first key): the
    view of a large buffer not yet written was saved as a copy, and ``big`` later as itself, so
    after a restore writes to ``big`` no longer showed through ``head`` (silently). A view that
    alone holds its large buffer is still a copy."""
    import numpy as np

    big = np.zeros(300_000)
    state = _round_trip({"head": big[:4], "big": big, "alone": np.ones(300_000)[:2]})
    state["big"][:4] += 1
    assert state["head"].tolist() == [1.0] * 4
    assert state["alone"].base is None


def test_arrays_and_memoryviews_over_a_bytearray_or_an_array_share_it_after_a_restore():
    """``np.frombuffer(buf)`` and ``memoryview(buf)`` came back as copies (the memoryview as
    ``bytes``): frozen at the checkpoint, silently, or failing at the first write through them."""
    import array

    import numpy as np

    buf, values = bytearray(8), array.array("d", [1.0, 2.0])
    grid = np.arange(6.0).reshape(2, 3)
    state = _round_trip({"buf": buf, "as_array": np.frombuffer(buf, np.uint8), "window": memoryview(buf)[2:6],
                         "values": values, "view": memoryview(values), "grid": grid, "rows": memoryview(grid)})
    state["buf"][3] = 7
    state["values"][1] = 5.0
    state["window"][0] = 9
    state["grid"][1, 1] = -1.0
    assert state["as_array"].tolist() == [0, 0, 9, 7, 0, 0, 0, 0]
    assert state["view"].tolist() == [1.0, 5.0] and state["rows"].tolist() == [[0.0, 1.0, 2.0], [3.0, -1.0, 5.0]]


def test_a_numpy_array_over_a_tensors_memory_shares_it_after_a_restore():
    """``wn = w.numpy()``: the array came back a copy, and writes through it no longer reached
    the tensor (silently)."""
    import torch

    import io

    from backend.proxy.checkpoint import dedup
    from backend.proxy.engine.state import ProxyPickler

    w = torch.zeros(4)
    buf = io.BytesIO()
    dedup.dump({"w": w, "wn": w.numpy(), "tail": w.numpy()[2:]}, buf, None, pickler=ProxyPickler)
    buf.seek(0)
    state = dedup.load(buf, None)
    state["wn"][1] = 5.0
    state["tail"][0] = 7.0
    assert state["w"].tolist() == [0.0, 5.0, 7.0, 0.0]
    state["w"].resize_(8)  # and the tensor stays resizable
