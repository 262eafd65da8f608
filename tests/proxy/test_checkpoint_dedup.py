"""Deduplicated multi-rank checkpoints: W data-parallel ranks store their replicated state once.

The engine tests run an unmodified DDP + Adam script as W real rank processes under
`python -m backend.proxy.launch --checkpoint-dir` (forked from the shared warm server), stop it
on a request from rank 0, and look at what was committed; the store tests drive
`CheckpointStore.write` with `dedup.dump` writers directly.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import json
import shutil
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch

from backend.proxy.checkpoint.digest import of_bytes as digest_of_bytes
from backend.proxy.checkpoint import dedup
from backend.proxy.launch import EXIT_PREEMPTED, RankResult, launch, shared_warm_server
from backend.proxy.distributed.layout import RankLayout
from backend.proxy.checkpoint.store import BLOB_DIR, CheckpointDamaged, CheckpointStore, RankFile

# 12 top-level statements before the loop: the loop's first safe point is step 13, so a stop at
# step >= 14 has at least one optimizer step (and Adam's moments) in the checkpoint.
TRAIN_SCRIPT = r'''
import hashlib, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 256))
ddp = DDP(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(steps):
    x = torch.randn(8, 128, generator=g)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    time.sleep(0.01)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print("final", rank, h.hexdigest(), hashlib.sha256(repr(losses).encode()).hexdigest())
'''
STEPS = 100
FIRST_TRAINED_STEP = 14
#: where rank 0 asks for the stop: mid-training, whatever the machine's speed
STOP_AT = 40
PER_RANK_ALLOWANCE = 64 * 1024  # a rank file (graph + tensor references) and its own small tensors


def run_job(script: Path, world: int, ckpt: Path, restore: bool = False,
            request: Optional[str] = None) -> list[RankResult]:
    env = {"SINGULARITY_TEST_REQUEST": request} if request else {}
    return launch(script, RankLayout.one_per_slot(world), args=[str(STEPS)], env=env, warm=shared_warm_server(),
                  timeout=90, launcher_args=["--checkpoint-dir", str(ckpt)] + (["--restore"] if restore else []))


def finals(results: list[RankResult]) -> list[str]:
    out = []
    for r in results:
        assert r.rc == 0, f"rank {r.rank} exited {r.rc}\n{r.stderr[-3000:]}"
        out.append(next(line for line in r.stdout.splitlines() if line.startswith("final ")))
    return out


def stopped_step(results: list[RankResult]) -> int:
    steps = set()
    for r in results:
        assert r.rc == EXIT_PREEMPTED, f"rank {r.rank} exited {r.rc}\n{r.stderr[-3000:]}"
        line = next(x for x in r.stderr.splitlines() if x.startswith("[proxy] stopped "))
        steps.add(json.loads(line[len("[proxy] stopped "):])["step"])
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    return steps.pop()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dedup") / "train.py"
    path.write_text(TRAIN_SCRIPT)
    return path


@pytest.fixture(scope="module")
def stopped(script: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """W -> the committed checkpoint of a run of W ranks stopped by rank 0 mid-training."""
    out = {}
    for world in (1, 2, 4):
        root = tmp_path_factory.mktemp(f"w{world}")
        step = stopped_step(run_job(script, world, root, request=f"0:@{STOP_AT}:stop"))
        assert step >= FIRST_TRAINED_STEP, f"W={world} stopped at step {step}, before training began"
        (ckpt,) = root.glob("ckpt-*")
        out[world] = ckpt
    return out


# ---------------------------------------------------------------------------- real jobs
def test_checkpoint_size_does_not_grow_with_world_size(stopped: dict[int, Path]) -> None:
    sizes = {world: folder_bytes(ckpt) for world, ckpt in stopped.items()}
    assert not (stopped[1] / BLOB_DIR).exists(), "one rank: a single torch.save file, as before"
    assert json.loads((stopped[1] / "manifest.json").read_text()).keys() == {
        "format", "step", "world_size", "created", "files"}
    assert sizes[1] > 2_000_000, "parameters and two Adam moments"
    for world in (2, 4):
        manifest = json.loads((stopped[world] / "manifest.json").read_text())
        on_disk = sorted(p.name for p in (stopped[world] / BLOB_DIR).iterdir())
        assert sorted(manifest["blobs"]) == on_disk, "the manifest lists every blob, nothing else is left"
        assert all(manifest["blobs"][d]["bytes"] == (stopped[world] / BLOB_DIR / d).stat().st_size for d in on_disk)
        assert sizes[world] - sizes[1] <= world * PER_RANK_ALLOWANCE, f"W={world}: {sizes}"
    assert sizes[4] < 1.1 * sizes[1], f"four replicas stored about once, not four times: {sizes}"


def test_restore_from_a_deduplicated_checkpoint_is_bitwise_identical(script: Path, stopped: dict[int, Path],
                                                                     tmp_path: Path) -> None:
    root = tmp_path / "restore"
    shutil.copytree(stopped[4], root / stopped[4].name)
    stale = root / ".ckpt-99999999.tmp" / BLOB_DIR
    stale.mkdir(parents=True)
    (stale / ("0" * 64 + ".claim")).touch()  # a crashed attempt's leftovers, above the restored step
    resumed = finals(run_job(script, 4, root, restore=True))
    assert not stale.parent.exists(), "rank 0 drops staging folders above the restored step"
    assert resumed == finals(run_job(script, 4, tmp_path / "uninterrupted"))


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_checkpoint_with_a_missing_or_torn_blob_is_skipped(stopped: dict[int, Path], tmp_path: Path,
                                                            damage: str) -> None:
    ckpt = tmp_path / stopped[4].name
    shutil.copytree(stopped[4], ckpt)
    blob = max((ckpt / BLOB_DIR).iterdir(), key=lambda p: p.stat().st_size)
    if damage == "delete":
        blob.unlink()
    else:
        blob.write_bytes(blob.read_bytes()[:-1])
    with pytest.warns(CheckpointDamaged, match=blob.name):
        assert CheckpointStore(tmp_path).latest() is None


# ---------------------------------------------------------------------------- the store with dedup writers
#: a tensor above dedup.INLINE_BYTES, so it goes to a blob
BIG = torch.arange(float(dedup.INLINE_BYTES // 4 + 1000))

def _dedup_writer(state: dict):
    def writer(f: RankFile) -> None:
        f.blobs.update(dedup.dump(state, f, dedup.BlobStore(f.blob_dir)).storages)
    return writer


def _write_two_ranks(store: CheckpointStore, step: int, shared: torch.Tensor) -> Path:
    for rank in (1, 0):
        ref = store.write(step, rank, 2, _dedup_writer({"w": shared, "rank": torch.tensor([rank, step])}))
    return ref.path


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_latest_falls_back_past_a_damaged_blob(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    older = _write_two_ranks(store, 1, BIG)
    newer = _write_two_ranks(store, 2, BIG * 2)
    manifest = json.loads((newer / "manifest.json").read_text())
    assert len(manifest["blobs"]) == 1, "one shared blob; each rank's small tensor is inline"
    blob = max((newer / BLOB_DIR).iterdir(), key=lambda p: p.stat().st_size)  # the shared one
    digest = blob.name
    if damage == "delete":
        blob.unlink()
    else:
        blob.write_bytes(blob.read_bytes()[:100])
    with pytest.warns(CheckpointDamaged, match=f"{BLOB_DIR}/{digest}"):
        ref = store.latest()
    assert ref is not None and ref.path == older and ref.step == 1


def test_a_blob_with_the_right_size_but_wrong_bytes_is_caught(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = _write_two_ranks(store, 3, torch.ones(BIG.numel()))
    blob = max((path / BLOB_DIR).iterdir(), key=lambda p: p.stat().st_size)
    blob.write_bytes(b"\0" * blob.stat().st_size)
    with pytest.warns(CheckpointDamaged, match="digest"):
        assert store.latest() is None


def test_a_stale_claim_does_not_suppress_a_blob(tmp_path: Path) -> None:
    """A claim whose writer died (its lock is gone) is taken over: the blob is written anyway."""
    store = CheckpointStore(tmp_path)
    shared = BIG
    staging = tmp_path / ".ckpt-00000004.tmp" / BLOB_DIR
    staging.mkdir(parents=True)
    digest = digest_of_bytes(dedup.storage_bytes(shared.untyped_storage()))
    (staging / f"{digest}.claim").touch()
    (staging / f"{digest}.1234.5678.part").write_bytes(b"half a blob")
    path = _write_two_ranks(store, 4, shared)
    assert sorted(p.name for p in (path / BLOB_DIR).iterdir()) == sorted(
        json.loads((path / "manifest.json").read_text())["blobs"]), "claims and temp files are dropped at commit"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = store.latest()
    assert ref is not None and digest in ref.blobs
    with open(ref.rank_file(0), "rb") as f:
        assert torch.equal(dedup.load(f, dedup.BlobStore(ref.blob_dir))["w"], shared)


def test_equal_bytes_load_as_separate_tensors(tmp_path: Path) -> None:
    """Two zero-initialised biases share a blob, not memory: an in-place update must not leak."""
    for n in (16, BIG.numel()):  # inline, and through one blob
        a, b = torch.zeros(n), torch.zeros(n)
        blobs = dedup.BlobStore(tmp_path / str(n))
        buf = io.BytesIO()
        stats = dedup.dump({"a": a, "b": b, "view": a[4:]}, buf, blobs)
        assert len(stats.storages) == (1 if n > 16 else 0)
        buf.seek(0)
        out = dedup.load(buf, blobs)
        out["a"][5] = 1.0
        assert out["b"].sum().item() == 0.0 and out["view"][1].item() == 1.0


def test_tensors_stay_resizable_after_a_checkpoint_and_a_restore(tmp_path: Path) -> None:
    """Writing a tensor through ``Tensor.numpy()`` marked its storage as not resizable for good, and
    a restored small storage lay in memory torch did not allocate: ``buf.resize_(n)``, ``torch.cat(...,
    out=buf)`` and quantization observers (which resize their buffers) raised in the running
    program after its first checkpoint, and after every restore."""
    state = {"buf": torch.zeros(2), "observer_min": torch.zeros(0), "bf16": torch.ones(3, dtype=torch.bfloat16)}
    buf = io.BytesIO()
    dedup.dump(state, buf, dedup.BlobStore(tmp_path / "blobs"))
    state["buf"].resize_(5)
    state["bf16"].resize_(6)
    buf.seek(0)
    out = dedup.load(buf, dedup.BlobStore(tmp_path / "blobs"))
    torch.cat([out["buf"], out["buf"]], out=out["observer_min"])
    out["buf"].resize_(7)
    assert out["observer_min"].shape == (4,) and out["buf"].shape == (7,)


def test_small_tensors_go_inline_once_per_storage(tmp_path: Path) -> None:
    """Thousands of tiny tensors cost no blob files; views keep sharing; nothing is lost."""
    tiny = [torch.randn(128) for _ in range(4096)]
    state = {"tiny": tiny, "views": [t[3:9] for t in tiny[:50]], "grad_like": tiny[0].clone()}
    blobs = dedup.BlobStore(tmp_path / "blobs")
    buf = io.BytesIO()
    stats = dedup.dump(state, buf, blobs)
    assert stats.storages == {} and not (tmp_path / "blobs").exists()
    assert stats.inline_bytes == 4097 * 512
    assert stats.file_bytes < 4097 * 512 * 1.3, "each storage's bytes are written once"
    buf.seek(0)
    out = dedup.load(buf, blobs)
    assert all(torch.equal(a, b) for a, b in zip(out["tiny"], tiny))
    out["tiny"][7][5] = 99.0
    assert out["views"][7][2].item() == 99.0, "a view shares its base's storage after loading"


def test_tensor_attributes_survive(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.randn(4))
    p.shard_info = {"owner": p, "tag": "x"}  # refers back to the tensor itself
    blobs = dedup.BlobStore(tmp_path)
    buf = io.BytesIO()
    dedup.dump({"p": p, "again": p}, buf, blobs)
    buf.seek(0)
    out = dedup.load(buf, blobs)
    assert out["again"] is out["p"] and out["p"].shard_info["owner"] is out["p"]
    assert torch.equal(out["p"], p) and isinstance(out["p"], torch.nn.Parameter)


def test_rank_files_of_earlier_engines_still_load(tmp_path: Path) -> None:
    """A torch.save zip archive (one rank) and a persistent-id pickle beside blobs (several ranks),
    as earlier versions wrote them, load with shared storage and parameters intact."""
    from backend.proxy.engine import state as state_module

    w = torch.nn.Parameter(torch.randn(50))
    graph = {"w": w, "view": w.data[10:20], "format": 1}
    zipped = tmp_path / "rank-0.pt"
    torch.save(graph, zipped, pickle_module=state_module.PICKLE_MODULE, pickle_protocol=4)
    loaded = state_module._read_graph(zipped, tmp_path / "no-blobs")
    assert torch.equal(loaded["w"], w) and isinstance(loaded["w"], torch.nn.Parameter)

    class OldPickler(pickle.Pickler):  # what dedup.dump wrote before tensors were reduced inline
        seen = False

        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor) and obj is w:
                if self.seen:
                    return ("sg-tensor", 0)
                self.seen = True
                data = dedup.storage_bytes(obj.untyped_storage())
                digest = hashlib.sha256(data).hexdigest()
                dedup.BlobStore(tmp_path / BLOB_DIR).put(digest, data)
                return ("sg-tensor", 0, (digest, obj.untyped_storage().nbytes(), "float32", (50,), (1,), 0,
                                         True, True, "cpu", 0))
            return None

    old = tmp_path / "rank-1.pt"
    with open(old, "wb") as f:
        OldPickler(f, protocol=4).dump({"w": w, "again": w, "format": 1})
    loaded = state_module._read_graph(old, tmp_path / BLOB_DIR)
    assert loaded["again"] is loaded["w"] and torch.equal(loaded["w"], w)
