"""Consistent cuts with real rank processes: agreement, stop/resume, resize, and a killed rank.

The engine tests run an unmodified DDP script under the resumable engine (`python -m
backend.proxy.launch --checkpoint-dir`), where a `DistributedController` turns one rank's request
into a checkpoint that every rank takes at the same safe point.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import pytest

from backend.proxy.distributed.collectives import EXIT_COLLECTIVE_FAILED
from backend.proxy.launch import EXIT_PREEMPTED, RankResult, launch, shared_warm_server
from backend.proxy.distributed.layout import RankLayout

POLL_SCRIPT = r'''
import json, os, sys, threading, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from backend.proxy.distributed.cut import default_cut

who, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
cut = default_cut()
model = nn.Linear(32, 32)
ddp = DDP(model) if mode == "ddp" else None
ticks_at_start = cut.ticks
current, fired, safe_points = [0], [], [0]

def fire():
    fired.append(current[0])  # the step running when the request arrives
    cut.request("continue")

if rank == who:
    threading.Timer(delay, fire).start()
decisions = []

def safe_point():
    safe_points[0] += 1  # what the engine passes: this rank's own count of safe points
    d = cut.poll(safe_points[0])
    if d is not None:
        decisions.append([current[0], d.then, d.exchanges])

for step in range(150):
    current[0] = step
    x = torch.randn(64, 32)
    if mode == "ddp":
        ddp(x).sum().backward()
    elif mode == "broadcast":  # collectives that carry no flag word: the cut ticks after every k
        dist.broadcast(x, src=step % dist.get_world_size())
    else:  # "skewed": loops bounded by time, a loop only rank 0 runs, an allreduce every 3 steps
        deadline = time.perf_counter() + 0.003
        while time.perf_counter() < deadline:
            x = torch.tanh(model(x))
            safe_point()
        if rank == 0:
            for _ in range(step % 5):
                safe_point()
        if step % 3 == 2:
            dist.all_reduce(torch.ones(4))
    time.sleep(0.004)
    safe_point()
print(json.dumps({"decisions": decisions, "requested": fired[0] if fired else None,
                  "ticks": cut.ticks - ticks_at_start}))
dist.destroy_process_group()
'''

TRAIN_SCRIPT = r'''
import glob, hashlib, os, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(60):
    if os.environ.get("TEST_CRASH") == f"{rank}:{step}":  # read each time: not part of the state
        # once the checkpoint asked for has committed (its writes run behind the loop): the
        # crash must find it there however slow the machine
        committed = os.path.join(os.environ.get("TEST_CRASH_AFTER", "."), "ckpt-*", "manifest.json")
        deadline = time.time() + 60
        while os.environ.get("TEST_CRASH_AFTER") and not glob.glob(committed) and time.time() < deadline:
            time.sleep(0.01)
        os._exit(9)
    x = torch.randn(8, 16, generator=g)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    time.sleep(0.008)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print("final", rank, h.hexdigest(), hashlib.sha256(repr(losses).encode()).hexdigest())
'''


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cut")
    out = {}
    for name, text in (("poll", POLL_SCRIPT), ("train", TRAIN_SCRIPT)):
        out[name] = folder / f"{name}.py"
        out[name].write_text(text)
    return out


def _events(r: RankResult, kind: str) -> list[dict]:
    prefix = f"[proxy] {kind} "
    return [json.loads(line[len(prefix):]) for line in r.stderr.splitlines() if line.startswith(prefix)]


# ---------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("mode", ["ddp", "broadcast", "skewed"])
def test_a_request_on_one_rank_at_a_random_moment_is_decided_at_one_step(scripts: dict, mode: str) -> None:
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    who, delay = rnd.randrange(4), rnd.uniform(0.05, 0.4)
    results = launch(scripts["poll"], RankLayout.parse("0|1|2|3"), args=[str(who), f"{delay:.3f}", mode],
                     env={"SINGULARITY_CUT_EVERY": "4"}, warm=shared_warm_server(), timeout=90)
    for r in results:
        assert r.rc == 0, f"seed {seed}: rank {r.rank} exited {r.rc}\n{r.stderr[-3000:]}"
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    decisions = [rep["decisions"] for rep in reports]
    assert len(decisions[0]) == 1, f"seed {seed}: expected one checkpoint, got {decisions[0]}"
    assert all(d == decisions[0] for d in decisions), f"seed {seed}: ranks disagree: {decisions}"
    step = decisions[0][0][0]
    requested = reports[who]["requested"]
    assert requested is not None and requested <= step <= requested + 5, (seed, requested, step)
    ticks = [rep["ticks"] for rep in reports]
    assert len(set(ticks)) == 1, f"seed {seed}: ranks ticked apart: {ticks}"
    if mode == "broadcast":
        assert ticks[0] == 150 // 4
    else:
        # allreduces carry the flag; the collectives that set DDP up count towards one tick at most
        assert ticks[0] <= 1, ticks


# ---------------------------------------------------------------------------- under the engine
def run_job(script: Path, placement: str, ckpt: Path, restore: bool = False, request: Optional[str] = None,
            crash: Optional[str] = None) -> list[RankResult]:
    env = {}
    if request:
        env["SINGULARITY_TEST_REQUEST"] = request
    if crash:
        env["TEST_CRASH"], env["TEST_CRASH_AFTER"] = crash, str(ckpt)
    return launch(script, RankLayout.parse(placement), env=env, warm=shared_warm_server(), timeout=90,
                  launcher_args=["--checkpoint-dir", str(ckpt)] + (["--restore"] if restore else []))


def finals(results: list[RankResult]) -> list[str]:
    out = []
    for r in results:
        assert r.rc == 0, f"rank {r.rank} exited {r.rc}\n{r.stderr[-3000:]}"
        out.append(next(line for line in r.stdout.splitlines() if line.startswith("final ")))
    return out


@pytest.fixture(scope="module")
def uninterrupted(scripts: dict, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return finals(run_job(scripts["train"], "0|1|2|3", tmp_path_factory.mktemp("base")))


def test_resize_4_2_1_4_at_random_moments_is_bitwise_identical(scripts: dict, uninterrupted: list[str],
                                                               tmp_path: Path) -> None:
    """Stop on one rank's request, restart on 2 slots, then 1, then 4: same parameters, same losses."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    plans = ["0|1|2|3", "0,1|2,3", "0,1,2,3"]
    steps = []
    for i, placement in enumerate(plans):
        request = f"{rnd.randrange(4)}:{rnd.uniform(0.05, 0.2):.3f}:stop"
        results = run_job(scripts["train"], placement, tmp_path, restore=i > 0, request=request)
        assert [r.rc for r in results] == [EXIT_PREEMPTED] * 4, \
            f"seed {seed}, {placement}: " + "\n".join(r.stderr[-1500:] for r in results)
        stopped = [_events(r, "stopped")[0]["step"] for r in results]
        assert len(set(stopped)) == 1, f"seed {seed}: ranks stopped at different steps {stopped}"
        steps.append(stopped[0])
    assert steps == sorted(steps) and len(set(steps)) == 3, f"seed {seed}: each segment must progress: {steps}"
    ckpt = sorted(tmp_path.glob("ckpt-*"))[-1]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and sorted(manifest["files"]) == [f"rank-{r}.pt" for r in range(4)]
    assert finals(run_job(scripts["train"], "0|1|2|3", tmp_path, restore=True)) == uninterrupted


def test_a_killed_rank_resumes_from_the_newest_consistent_checkpoint(scripts: dict, uninterrupted: list[str],
                                                                    tmp_path: Path) -> None:
    results = run_job(scripts["train"], "0|1|2|3", tmp_path, request="2:0.1:continue", crash="1:45")
    assert results[1].rc == 9
    peers = [r for r in results if r.rank != 1]
    assert all(r.rc == EXIT_COLLECTIVE_FAILED and "collective_failed" in r.stderr for r in peers), \
        [(r.rc, r.stderr[-800:]) for r in peers]
    written = [_events(r, "checkpointed") for r in results]
    assert all(len(w) == 1 for w in written) and len({w[0]["step"] for w in written}) == 1
    assert finals(run_job(scripts["train"], "0|1|2|3", tmp_path, restore=True)) == uninterrupted
