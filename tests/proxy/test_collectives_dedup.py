"""Content-addressed tensors: a W-rank checkpoint of data-parallel replicas is one model's size."""
from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from backend.proxy.checkpoint import dedup
from backend.proxy.launch import launch, shared_warm_server
from backend.proxy.distributed.layout import RankLayout


#: elements of a float32 tensor big enough for a blob of its own (small ones go inline)
BIG = dedup.INLINE_BYTES // 4 + 1024


def roundtrip(obj: object, folder: Path) -> tuple[object, dedup.DumpStats]:
    blobs = dedup.BlobStore(folder)
    buf = io.BytesIO()
    stats = dedup.dump(obj, buf, blobs)
    buf.seek(0)
    return dedup.load(buf, blobs), stats


def test_identity_views_parameters_and_optimizer_state_survive(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    base = torch.arange(12.0)
    graph = {"model": model, "opt": opt, "base": base, "view": base[3:7], "t": base.view(3, 4).t(),
             "ints": torch.arange(4, dtype=torch.int16), "empty": torch.empty(0), "sparse": torch.eye(3).to_sparse(),
             "again": model[0].weight}
    out, stats = roundtrip(graph, tmp_path)
    m = out["model"]
    assert out["again"] is m[0].weight and isinstance(m[0].weight, torch.nn.Parameter)
    assert out["opt"].param_groups[0]["params"][0] is m[0].weight, "optimizer and model share parameters"
    assert torch.equal(out["opt"].state[m[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    for a, b in zip(m.parameters(), model.parameters()):
        assert torch.equal(a, b) and a.requires_grad
    out["base"][4] = -1.0
    assert out["view"][1].item() == -1.0 and out["t"][0, 1].item() == -1.0, "views share the loaded storage"
    assert out["t"].stride() == (1, 4) and out["ints"].dtype == torch.int16 and out["empty"].numel() == 0
    assert torch.equal(out["sparse"].to_dense(), torch.eye(3)), "sparse tensors go inline"
    big = torch.arange(float(BIG))
    _, stats = roundtrip({"a": big, "v": big[3:7], "t": big.view(-1, 4).t(), "copy": big.clone()},
                         tmp_path / "small")
    assert stats.tensors == 4 and len(stats.storages) == 1, "views share a storage, equal bytes share a blob"
    assert stats.blob_bytes_written == BIG * 4


def test_concurrent_ranks_write_each_blob_once(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(BIG) for i in range(10)}
    stats: list[dedup.DumpStats] = []
    barrier = threading.Barrier(4)

    def rank() -> None:
        barrier.wait()
        stats.append(dedup.dump(state, io.BytesIO(), dedup.BlobStore(tmp_path)))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(s.blob_bytes_written for s in stats) == 10 * BIG * 4
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(list(stats[0].storages) + [d + ".claim" for d in stats[0].storages]), "no parts left"
    assert all(dedup.BlobStore(tmp_path).verify(d) for d in stats[0].storages)


def test_a_damaged_blob_is_refused(tmp_path: Path) -> None:
    blobs = dedup.BlobStore(tmp_path)
    buf = io.BytesIO()
    stats = dedup.dump({"w": torch.ones(BIG)}, buf, blobs)
    (digest,) = stats.storages
    blobs.path(digest).write_bytes(b"\0" * 10)
    buf.seek(0)
    with pytest.raises(ValueError, match="bytes"):
        dedup.load(buf, blobs)
    assert not blobs.verify(digest)


SAVE_SCRIPT = r'''
import io, json, sys
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from backend.proxy.checkpoint import dedup

folder = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
ddp = DDP(model)
opt = torch.optim.Adam(ddp.parameters())
g = torch.Generator().manual_seed(rank)
for step in range(3):
    ddp(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
state = {"model": model, "opt": opt, "step": 3, "rank": rank}
blobs = dedup.BlobStore(folder / dedup.BLOB_DIR)
with open(folder / f"rank-{rank}.pkl", "wb") as f:
    stats = dedup.dump(state, f, blobs)
naive = io.BytesIO()
torch.save(state, naive)
print(json.dumps({"file": stats.file_bytes, "referenced": stats.referenced_bytes,
                  "written": stats.blob_bytes_written, "naive": len(naive.getvalue())}))
dist.destroy_process_group()
'''


def test_checkpoint_size_does_not_grow_with_world_size(tmp_path: Path) -> None:
    script = tmp_path / "save.py"
    script.write_text(SAVE_SCRIPT)
    sizes, reports = {}, {}
    for world in (1, 2, 4):
        folder = tmp_path / f"w{world}"
        folder.mkdir()
        results = launch(script, RankLayout.one_per_slot(world), args=[str(folder)], warm=shared_warm_server(),
                         timeout=90)
        for r in results:
            assert r.rc == 0, f"W={world} rank {r.rank}: {r.stderr[-2000:]}"
        reports[world] = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
        blobs = dedup.BlobStore(folder / dedup.BLOB_DIR)
        rank_files = [folder / f"rank-{r}.pkl" for r in range(world)]
        sizes[world] = (blobs.total_bytes(), [p.stat().st_size for p in rank_files])
        loaded = []
        for p in rank_files:
            with open(p, "rb") as f:
                loaded.append(dedup.load(f, blobs))
        for state in loaded:
            assert state["opt"].param_groups[0]["params"][0] is state["model"][0].weight
            for a, b in zip(state["model"].parameters(), loaded[0]["model"].parameters()):
                assert torch.equal(a, b)
    model_bytes = sizes[1][0]
    assert model_bytes > 1_500_000  # parameters and two Adam moments
    per_rank_file = max(s for _blob, files in sizes.values() for s in files)
    assert per_rank_file < 16_000, "a rank file holds the graph, tensor metadata and the small tensors (biases)"
    for world in (2, 4):
        assert sizes[world][0] == model_bytes, f"W={world}: replicated tensors stored more than once"
        total = sizes[world][0] + sum(sizes[world][1])
        assert total - (model_bytes + sum(sizes[1][1])) <= (world - 1) * per_rank_file
        written = sum(rep["written"] for rep in reports[world])
        assert written == model_bytes, "each blob was written by one rank only"
        assert total < 0.6 * world * reports[world][0]["naive"], "smaller than W plain torch.save files"
