"""Unmodified torchrun-style DDP scripts under the singularity backend, as real rank processes.

Each run starts W processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (forked from a warm
server that has imported torch; every rank is its own process) and a placement.  With the exact
reduction, final parameters and every loss are bitwise identical whatever the placement; the
plain one (gloo's own order) is the control that shows the comparison can fail.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from backend.proxy.launch import RankResult, launch, shared_warm_server
from backend.proxy.distributed.layout import RankLayout

DDP_SCRIPT = r'''
import hashlib, json, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1])
busy = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 48), nn.BatchNorm1d(48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh())
        self.head = nn.Linear(48, 6)
        self.unused = nn.Linear(6, 6)  # never called: find_unused_parameters' extra allreduce
    def forward(self, x):
        return self.head(self.body(x))

torch.manual_seed(rank)  # replicas start different: DDP's broadcast must align them
model = Net()
ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=True)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(7 + rank)
losses, intervals = [], []
for step in range(steps):
    x, y = torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)
    t0 = time.monotonic()
    if busy:
        a = torch.randn(64, 64, generator=g)
        while time.monotonic() - t0 < busy:
            a = torch.tanh(a @ a)
    intervals.append((t0, time.monotonic()))  # pure compute: no collective inside
    accumulate = step % 3 == 1
    if accumulate:
        with ddp.no_sync():
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        continue
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank})
sub = dist.new_group(backend="gloo")  # asked by name: wrapped as well
t = torch.tensor([float(rank)])
dist.all_reduce(t, group=sub)
e = torch.tensor([float(rank)])
try:
    evens = dist.new_group(ranks=list(range(0, world, 2)))  # splits a shared slot: refused
    if rank % 2 == 0:
        dist.all_reduce(e, group=evens)
except ValueError as err:
    e = torch.tensor([-1.0 if "split" in str(err) else -2.0])
dist.barrier()
def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()
pg = dist.distributed_c10d._get_default_group()
print(json.dumps({"rank": rank, "params": digest(model.parameters()), "buffers": digest(model.buffers()),
                  "losses": losses, "backend": str(dist.get_backend()),
                  "group": type(pg).__name__, "objs": objs, "sub": [type(sub).__name__, t.item()],
                  "evens": e.item(), "intervals": intervals,
                  "turns": getattr(getattr(pg, "turns", None), "turns", 0)}))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ddp") / "ddp_train.py"
    path.write_text(DDP_SCRIPT)
    return path


def run(script: Path, placement: str, reduction: Optional[str] = "exact", steps: int = 8, busy: float = 0.0,
        env: Optional[dict] = None) -> list[dict]:
    results = launch(script, RankLayout.parse(placement), args=[str(steps), str(busy)], reduction=reduction,
                     env=env, warm=shared_warm_server(), timeout=90)
    return [_report(r) for r in results]


def _report(r: RankResult) -> dict:
    assert r.rc == 0, f"rank {r.rank} exited {r.rc}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def outcome(reports: list[dict]) -> list[tuple[str, list]]:
    return [(rep["params"], rep["buffers"], rep["losses"]) for rep in reports]


def test_ddp_runs_unmodified_through_the_wrapper(script: Path) -> None:
    reports = run(script, "0|1")
    spliced = run(script, "0,1")
    for rank, rep in enumerate(spliced):
        assert rep["sub"] == ["SingularityProcessGroup", 1.0]
        assert rep["evens"] == -1.0, "a subgroup splitting a shared slot is refused with a clear error"
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank
        assert rep["group"] == "SingularityProcessGroup"
        assert rep["backend"] == "gloo", "the user's code sees the backend it asked for"
        assert rep["objs"] == [{"rank": 0}, {"rank": 1}]
        assert rep["sub"] == ["SingularityProcessGroup", 1.0]
        assert rep["evens"] == (0.0 if rank == 0 else 1.0)
    assert reports[0]["params"] == reports[1]["params"], "replicas diverged"
    assert reports[0]["losses"] != reports[1]["losses"]  # different data per rank, same parameters


@pytest.mark.parametrize("world,placements", [
    (2, ["0|1", "1|0", "0,1"]),
    (4, ["0|1|2|3", "3|1|0|2", "0,1|2,3", "0,1,2,3", "2,3|0,1"]),
])
def test_ddp_is_bitwise_identical_whatever_the_placement(script: Path, world: int, placements: list[str]) -> None:
    baseline = outcome(run(script, placements[0]))
    assert len({params for params, _, _ in baseline}) == 1
    for placement in placements[1:]:
        assert outcome(run(script, placement)) == baseline, f"placement {placement} changed the bits"


def test_plain_gloo_reduction_is_not_placement_independent(script: Path) -> None:
    """Control for the test above: the same comparison fails with gloo's own reduction order."""
    a = outcome(run(script, "0|1|2|3", reduction="plain"))
    b = outcome(run(script, "3|1|0|2", reduction="plain"))
    assert a != b
    assert a[0][2][0] == b[0][2][0], "the first loss is computed before any reduction"


def _overlaps(a: list, b: list) -> int:
    return sum(1 for s0, e0 in a for s1, e1 in b if s0 < e1 and s1 < e0)


def test_co_located_ranks_take_turns(script: Path) -> None:
    """Two slots of two ranks: within a slot only one rank computes at a time; results unchanged."""
    spliced = run(script, "0,1|2,3", steps=6, busy=0.02)
    for a, b in ((0, 1), (2, 3)):
        assert _overlaps(spliced[a]["intervals"], spliced[b]["intervals"]) == 0
    assert all(rep["turns"] > 6 for rep in spliced)
    assert outcome(spliced) == outcome(run(script, "0|1|2|3", steps=6, busy=0.02))
    free = run(script, "0,1|2,3", steps=6, busy=0.02, env={"SINGULARITY_TURNS": "0"})
    assert _overlaps(free[0]["intervals"], free[1]["intervals"]) + \
        _overlaps(free[2]["intervals"], free[3]["intervals"]) > 0, "control: without turns they overlap"
