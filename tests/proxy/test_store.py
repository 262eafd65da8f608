"""The on-disk format: atomic commits, verification, multi-rank sets, pruning."""
from __future__ import annotations

import json
import time

import pytest

from backend.proxy import CheckpointError, CheckpointStore
from backend.proxy.checkpoint.store import CheckpointDamaged


def _bytes(payload: bytes):
    def writer(f):
        f.write(payload[: len(payload) // 2])
        f.write(payload[len(payload) // 2:])
    return writer


def test_commit_layout_manifest_and_latest(tmp_path):
    store = CheckpointStore(tmp_path)
    ref = store.write(7, 0, 1, _bytes(b"hello world"))
    assert ref.path == tmp_path / "ckpt-00000007" and ref.step == 7
    assert sorted(p.name for p in ref.path.iterdir()) == ["manifest.json", "rank-0.pt"]
    manifest = json.loads((ref.path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["files"]["rank-0.pt"]["bytes"] == 11
    assert len(manifest["files"]["rank-0.pt"]["xxh3_128"]) == 32 and manifest["created"]
    latest = store.latest()
    assert latest is not None and latest.step == 7 and latest.rank_file(0).read_bytes() == b"hello world"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000007"]


def test_checkpoints_hashed_with_sha256_by_earlier_engines_still_verify(tmp_path):
    import hashlib

    store = CheckpointStore(tmp_path)
    ref = store.write(3, 0, 1, _bytes(b"written by an earlier engine"))
    mpath = ref.path / "manifest.json"
    manifest = json.loads(mpath.read_text())
    entry = manifest["files"]["rank-0.pt"]
    del entry["xxh3_128"]
    entry["sha256"] = hashlib.sha256(b"written by an earlier engine").hexdigest()
    mpath.write_text(json.dumps(manifest))
    assert store.latest() is not None
    entry["sha256"] = hashlib.sha256(b"something else").hexdigest()
    mpath.write_text(json.dumps(manifest))
    with pytest.warns(CheckpointDamaged, match="sha256 digest"):
        assert store.latest(contents=True) is None


def test_failed_writer_leaves_previous_checkpoints_untouched(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, 0, 1, _bytes(b"one"))

    def broken(f):
        f.write(b"partial")
        raise TypeError("cannot pickle 'socket' object")

    with pytest.raises(TypeError):
        store.write(2, 0, 1, broken)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001"]
    assert store.latest().step == 1


def test_damaged_checkpoints_are_skipped_with_a_warning_naming_them(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (1, 2, 3, 4):
        store.write(step, 0, 1, _bytes(b"x" * 100 + bytes([step])))
    (tmp_path / "ckpt-00000004" / "rank-0.pt").write_bytes(b"y" * 101)  # same size, other bytes
    (tmp_path / "ckpt-00000003" / "manifest.json").unlink()
    (tmp_path / "ckpt-00000002" / "rank-0.pt").write_bytes(b"short")
    with pytest.warns(CheckpointDamaged) as caught:
        ref = store.latest(contents=True)
    assert ref is not None and ref.step == 1
    messages = [str(w.message) for w in caught]
    assert "ckpt-00000004" in messages[0] and "digest" in messages[0]
    assert "ckpt-00000003" in messages[1] and "manifest.json is missing" in messages[1]
    assert "ckpt-00000002" in messages[2] and "bytes" in messages[2]
    with pytest.raises(CheckpointError, match="digest"):
        store.verify(tmp_path / "ckpt-00000004", contents=True)
    # by default a one-rank file's digest is left to the restore, which hashes it while reading
    assert store.verify(tmp_path / "ckpt-00000004").step == 4


def test_staging_folders_are_never_read_and_are_pruned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.write(1, 0, 1, _bytes(b"a"))
    (tmp_path / ".ckpt-00000002.tmp").mkdir()
    (tmp_path / ".ckpt-00000002.tmp" / "rank-0.pt.part").write_bytes(b"half")
    assert store.latest().step == 1
    store.write(3, 0, 1, _bytes(b"b"))
    store.write(5, 0, 1, _bytes(b"c"))
    store.remove_pruned()  # what the thread behind the commit does (and the agent after an exit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "ckpt-00000005"]


def test_a_pruned_checkpoint_leaves_readers_sight_at_the_commit_and_the_disk_behind_it(tmp_path):
    """The commit renames what it prunes out of sight and leaves the removal to a thread; what a
    process that exits at once leaves (a preempted worker) goes at the next prune or `clear`."""
    store = CheckpointStore(tmp_path, keep=1)
    store.write(1, 0, 1, _bytes(b"a"))
    left = tmp_path / ".ckpt-00000000.999-0.pruned"  # a process that died before its thread ran
    (left / "blobs").mkdir(parents=True)
    (left / "rank-0.pt").write_bytes(b"old")
    store.write(2, 0, 1, _bytes(b"b"))
    assert [p.name for p in store.checkpoints()] == ["ckpt-00000002"]
    assert not (tmp_path / "ckpt-00000001").exists()
    deadline = time.monotonic() + 30  # a liveness bound for the thread, not a timing claim
    while [p for p in tmp_path.iterdir() if p.name.endswith(".pruned")] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002"]
    (tmp_path / ".ckpt-00000001.999-1.pruned").mkdir()
    store.clear()
    assert list(tmp_path.iterdir()) == []


def test_multi_rank_set_commits_only_when_every_rank_wrote(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(4, 1, 2, _bytes(b"rank one"))
    assert store.latest() is None and (tmp_path / ".ckpt-00000004.tmp").is_dir()
    ref = store.write(4, 0, 2, _bytes(b"rank zero"))
    latest = store.latest()
    assert latest is not None and latest.path == ref.path and latest.world_size == 2
    assert latest.rank_file(0).read_bytes() == b"rank zero" and latest.rank_file(1).read_bytes() == b"rank one"
    assert sorted(p.name for p in ref.path.iterdir()) == ["manifest.json", "rank-0.pt", "rank-1.pt"]


def test_same_step_is_replaced_and_clear_removes_everything(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(9, 0, 1, _bytes(b"first"))
    store.write(9, 0, 1, _bytes(b"second"))
    assert store.latest().rank_file(0).read_bytes() == b"second"
    store.clear()
    assert list(tmp_path.iterdir()) == [] and store.latest() is None


def test_a_rank_that_cannot_write_its_part_says_so_to_whoever_waits_for_the_set(tmp_path):
    """Ranks write their parts behind their loops: one that fails leaves a note, so rank 0 stops
    waiting for a commit that cannot come (the set stays uncommitted, never read)."""
    store = CheckpointStore(tmp_path)
    ref = store.write(3, 0, 2, lambda f: f.write(b"rank 0's part"))
    assert store.failed_parts(ref.path) == []

    def full(f):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.write(3, 1, 2, full)
    [said] = store.failed_parts(ref.path)
    assert "No space left on device" in said
    assert store.latest() is None
