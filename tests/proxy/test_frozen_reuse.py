"""A fine-tuned model's frozen parameters are written once, not by every checkpoint.

A one-rank checkpoint sends each frozen parameter (``requires_grad`` False, at least
`dedup.REUSABLE_BYTES`) to a blob named by its digest; the next checkpoint hashes it where it lies
and hard-links the blob of the checkpoint before when the bytes are the same, in line (a
preemption) or behind the loop (a periodic checkpoint: then not even copied at the safe point).
The digest decides, never a hint: a frozen parameter changed behind autograd's back is written
again, and a damaged blob is refused at restore."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from backend.proxy.checkpoint.store import CheckpointStore, DigestMismatch, expected_digest
from backend.proxy.engine import background, state
from harness import assert_chains_match, run_chain, trace_of

MIB = 1 << 20


def _model() -> dict:
    torch.manual_seed(0)
    backbone = torch.nn.Parameter(torch.randn(512, 1024), requires_grad=False)  # 2 MiB, frozen
    head = torch.nn.Parameter(torch.randn(512, 1024))  # 2 MiB, trained
    return {"backbone": backbone, "head": head, "moment": torch.zeros(512, 1024), "step": 0}


def _write(store: CheckpointStore, step: int, graph: dict) -> dict:
    written: dict = {}

    def writer(f) -> None:
        written["blob_bytes"] = state.save_graph(graph, f, blobs=f.blobs, one_rank=True)
        written["file_bytes"] = f.bytes
    store.write(step, 0, 1, writer)
    return written


def _load(store: CheckpointStore) -> dict:
    ref = store.latest()
    return state._read_graph(ref.rank_file(0), ref.blob_dir, expected_digest(ref, "rank-0.pt"))


def _blob(store: CheckpointStore, step: int) -> list[Path]:
    return sorted((store.root / f"ckpt-{step:08d}" / "blobs").iterdir())


def test_an_unchanged_frozen_parameter_is_linked_and_a_changed_one_written(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    g = _model()
    first = _write(store, 1, g)
    assert first["blob_bytes"] == 2 * MIB and first["file_bytes"] < 4.1 * MIB  # head and moment inline
    [frozen] = _blob(store, 1)
    with torch.no_grad():
        g["head"].add_(1.0)
        g["moment"].add_(0.5)
    g["step"] = 1
    second = _write(store, 2, g)
    assert second["blob_bytes"] == 0, second
    [linked] = _blob(store, 2)
    assert linked.name == frozen.name and os.stat(linked).st_ino == os.stat(frozen).st_ino
    back = _load(store)
    assert back["step"] == 1 and isinstance(back["backbone"], torch.nn.Parameter)
    assert not back["backbone"].requires_grad and back["head"].requires_grad
    for k in ("backbone", "head", "moment"):
        assert torch.equal(back[k], g[k]), k

    g["backbone"].data[3, 5] += 1.0  # through .data: the version counter does not see it
    third = _write(store, 3, g)
    assert third["blob_bytes"] == 2 * MIB
    [rewritten] = _blob(store, 3)
    assert rewritten.name != frozen.name
    assert torch.equal(_load(store)["backbone"], g["backbone"])


def test_a_damaged_linked_blob_is_refused_at_restore(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    g = _model()
    _write(store, 1, g)
    _write(store, 2, g)
    [blob] = _blob(store, 2)
    with open(blob, "r+b") as f:  # the same inode as step 1's: both checkpoints share the damage
        f.seek(1000)
        f.write(b"\xff\x00\xff")
    with pytest.raises(DigestMismatch, match="does not match its digest"):
        _load(store)


def test_behind_the_loop_an_unchanged_frozen_parameter_is_neither_copied_nor_written(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    g = _model()
    snap = background.Snapshot(store.reusable_blob_dirs())
    state.save_graph(g, snap, one_rank=True)
    assert snap.blobs.copied_bytes == 2 * MIB  # no checkpoint before: copied like the rest
    store.write(1, 0, 1, snap.write_to)

    with torch.no_grad():
        g["head"].mul_(2.0)
    g["step"] = 1
    snap = background.Snapshot(store.reusable_blob_dirs())
    state.save_graph(g, snap, one_rank=True)
    assert snap.blobs.copied_bytes == 0 and snap.bytes < 4.1 * MIB
    expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()}
    with torch.no_grad():  # the loop goes on before the write behind it
        g["head"].add_(3.0)
    store.write(2, 0, 1, snap.write_to)
    assert snap.blobs.linked_bytes == 2 * MIB
    back = _load(store)
    for k in ("backbone", "head", "moment"):
        assert torch.equal(back[k], expected[k]), k

    # a frozen parameter changed before the snapshot is copied at the safe point, so a change
    # after it does not reach the checkpoint
    g["backbone"].data.mul_(-1.0)
    expected_backbone = g["backbone"].detach().clone()
    snap = background.Snapshot(store.reusable_blob_dirs())
    state.save_graph(g, snap, one_rank=True)
    assert snap.blobs.copied_bytes == 2 * MIB
    g["backbone"].data.add_(7.0)
    store.write(3, 0, 1, snap.write_to)
    assert torch.equal(_load(store)["backbone"], expected_backbone)


def test_a_snapshot_keeps_a_device_storages_host_copy_and_copies_a_view_of_live_memory(tmp_path):
    """A device storage reaches the snapshot as a host array made for it (`to_host`): keeping that
    array is safe and saves a second copy of the model's bytes. A CPU tensor's bytes, and a numpy
    array of the program's own (which owns its memory as a host copy does), are views of memory
    the loop changes next, so they are copied."""
    import pickle

    import numpy as np

    from backend.proxy.checkpoint import dedup
    from backend.proxy.checkpoint.host_copy import to_host

    blobs = background.SnapshotBlobs(())
    private = memoryview(to_host(torch.arange(1024, dtype=torch.float32).untyped_storage()))
    live_tensor = torch.arange(1024, dtype=torch.float32)
    live = dedup.storage_bytes(live_tensor.untyped_storage())
    blobs.put("a" * 32, private)
    blobs.put("b" * 32, live)
    assert blobs.pending["a" * 32][1] is private  # kept, not copied again
    live_tensor.add_(1.0)  # the loop goes on
    assert bytes(blobs.pending["b" * 32][1]) == torch.arange(1024, dtype=torch.float32).numpy().tobytes()
    assert blobs.copied_bytes == 2 * 4096

    # inline pieces, as the pickler hands them over (protocol 5 `PickleBuffer`s)
    snap = background.Snapshot()
    host = to_host(torch.ones(256).untyped_storage())
    mine = np.zeros(4096, dtype=np.uint8)  # the program's array: owns its memory, changes next
    snap.write(pickle.PickleBuffer(memoryview(host)))
    snap.write(pickle.PickleBuffer(mine))
    assert np.shares_memory(np.asarray(snap.parts[0]), host)
    mine += 7
    assert isinstance(snap.parts[1], bytes) and snap.parts[1] == bytes(4096)


def test_a_snapshot_of_host_copies_written_after_the_loop_changed_the_tensors_holds_the_safe_points(
        tmp_path, monkeypatch):
    """The whole path a GPU job's periodic checkpoint takes, on CPU: every storage copied to the
    host at the safe point (as `storage_bytes` does for a device), the snapshot keeping those
    copies, the tensors changed before the write; the checkpoint holds the safe point's values."""
    from backend.proxy.checkpoint import dedup
    from backend.proxy.checkpoint.host_copy import to_host

    monkeypatch.setattr(dedup, "storage_bytes", lambda storage: memoryview(to_host(storage)))
    store = CheckpointStore(tmp_path / "ck")
    g = _model()
    expected = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in g.items()}
    snap = background.Snapshot(store.reusable_blob_dirs())
    state.save_graph(g, snap, one_rank=True)
    assert any(isinstance(p, memoryview) for p in snap.parts)  # host copies kept, not copied again
    with torch.no_grad():  # the loop goes on before the write behind it
        for k in ("backbone", "head", "moment"):
            g[k].add_(5.0)
    store.write(1, 0, 1, snap.write_to)
    back = _load(store)
    for k in ("backbone", "head", "moment"):
        assert torch.equal(back[k], expected[k]), k


FINE_TUNE = """
import argparse
import time
import torch

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 64))
    for p in backbone.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(64, 1)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for step in range(args.steps):
        x = torch.randn(16, 64)
        loss = (head(backbone(x)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, f"{loss.item():.8f}")
        time.sleep(0.02)

if __name__ == "__main__":
    main()
"""


def test_a_fine_tuning_script_resumes_exactly_writing_its_frozen_backbone_once(launcher, tmp_path):
    script = tmp_path / "finetune.py"
    script.write_text(textwrap.dedent(FINE_TUNE))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    assert len(base.stdout.splitlines()) == 24
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1,), extra=2)

    # each preemption after the first links the two 1 MiB weights of the backbone
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, target, [loops[3], loops[9], loops[15]], tmp_path / "ck-bytes")
    assert out == base.stdout
    written = [d["bytes"] for r in runs[:3] for _, d in r.events("checkpointed")]
    assert written[0] > 2 * MIB and all(b < MIB for b in written[1:]), written

    # periodic checkpoints behind the loop, then a preemption: the same output
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck-p"), "--checkpoint-every", "0.01",
                                 "--stop-at-step", str(loops[12])])
    periodic = [d for _, d in run.events("checkpointed") if d.get("background")]
    # inside the loop the backbone is frozen: from the second checkpoint there on, it is linked
    # (before, it may not exist yet, or still be trainable and go inline)
    in_loop = [(d["step"], d["bytes"]) for d in periodic if d["step"] > loops[0]]
    assert len(in_loop) >= 2 and all(b < MIB for _s, b in in_loop[1:]), (in_loop, loops[0])
    final = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck-p"), "--restore"])
    assert run.stdout + final.stdout == base.stdout, final.describe()


def test_several_ranks_link_every_unchanged_blob_of_the_checkpoint_before(tmp_path):
    """With several ranks every large storage is a blob (shared by the ranks); a preemption's
    checkpoint links the ones the checkpoint before has, trained or frozen, and writes the rest."""
    store = CheckpointStore(tmp_path / "ck", keep=3)
    g = _model()

    def write(step: int) -> int:
        written = 0
        for rank in (0, 1):
            def writer(f) -> None:
                nonlocal written
                written += state.save_graph(g, f, blobs=f.blobs)
            store.write(step, rank, 2, writer)
        return written
    assert write(1) == 6 * MIB  # backbone, head, moment: once for both ranks
    with torch.no_grad():
        g["head"].add_(1.0)
    assert write(2) == 2 * MIB  # only the head changed
    ref = store.latest()
    assert len(ref.blobs) == 3
    back = state._read_graph(ref.rank_file(1), ref.blob_dir)
    for k in ("backbone", "head", "moment"):
        assert torch.equal(back[k], g[k]), k


def test_ranks_writing_behind_the_loop_write_each_blob_once_and_link_the_unchanged(tmp_path):
    """Two ranks' snapshots of replicated state: each large storage is a blob, written by one
    rank (the other finds it claimed or there), and the next checkpoint links the unchanged."""
    store = CheckpointStore(tmp_path / "ck", keep=3)
    g = _model()

    def checkpoint(step: int) -> list[int]:
        snaps = []
        for _rank in (0, 1):  # both snapshots are taken before either is written, as at a safe point
            snap = background.Snapshot(store.reusable_blob_dirs())
            state.save_graph(g, snap)
            snaps.append(snap)
        written = []
        for rank, snap in enumerate(snaps):
            def writer(f, snap=snap) -> None:
                written.append(snap.blobs.write_to(f))
                for piece in snap.parts:
                    f.write(piece)
            store.write(step, rank, 2, writer)
        return [s.blobs.copied_bytes for s in snaps] + written

    assert checkpoint(1) == [6 * MIB, 6 * MIB, 6 * MIB, 0]
    with torch.no_grad():
        g["head"].add_(1.0)
    assert checkpoint(2) == [2 * MIB, 2 * MIB, 2 * MIB, 0]  # the backbone and the moment linked
    ref = store.latest()
    assert sorted(os.stat(ref.blob_dir / b).st_nlink for b in ref.blobs) == [1, 2, 2]
    for rank in (0, 1):
        back = state._read_graph(ref.rank_file(rank), ref.blob_dir)
        for k in ("backbone", "head", "moment"):
            assert torch.equal(back[k], g[k]), (rank, k)
