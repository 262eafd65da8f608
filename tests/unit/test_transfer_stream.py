"""The upload of a checkpoint to a store overlaps its write (backend/agent/transfer.py, `Streamer`),
and nothing it streams is ever restored unless it is exactly the committed checkpoint.

Real parts throughout: the checkpoint store's own writer, a file:// fsspec store, the streamer's
thread, and for kill -9 a real process killed half-way through a write."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backend.agent.transfer import STREAMS, CheckpointTransfer, StaleAttempt
from backend.proxy.checkpoint import digest
from backend.proxy.checkpoint.store import SLEEP_HOOK_ENV, CheckpointStore
from transfer_scenarios import until as _until
from transfer_scenarios import write_twice_under_one_name

MB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _streamed(store: Path, attempt: int, step: int) -> Path:
    return store / "job" / STREAMS / f"a{attempt}" / f"ckpt-{step:08d}" / "rank-0.pt"


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else -1


def _fetch(store: Path, cache: Path, upto: int | None = None):
    """What a destination node restores: download, then the newest checkpoint that verifies with
    every file hashed."""
    CheckpointTransfer(store.as_uri(), cache).download("job", upto=upto)
    return CheckpointStore(cache / "job").latest(contents=True)


def test_the_upload_overlaps_the_write_and_publishes_exactly_the_committed_bytes(tmp_path):
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    first, second = os.urandom(3 * MB), os.urandom(2 * MB)
    seen = {}

    def writer(f):
        f.write(first)
        f.flush()
        part = _streamed(store, 1, 7)
        # the first half is in the store while the writer has not written the second
        _until(lambda: _size(part) == len(first), "the written half streamed to the store")
        seen["inode"] = part.stat().st_ino
        f.write(second)

    streamer = t.stream("job", 1).start()
    try:
        ref = CheckpointStore(tmp_path / "src" / "job").write(7, 0, 1, writer)
        t.upload("job", 1, ref.path)
    finally:
        streamer.stop()
    published = store / "job" / "ckpt-00000007" / "rank-0.pt"
    assert published.read_bytes() == first + second
    assert published.stat().st_ino == seen["inode"], "the streamed copy was moved into place, not sent again"
    assert not [p for p in (store / "job" / STREAMS).rglob("*") if p.is_file()]
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.step == 7
    assert restored.rank_file(0).read_bytes() == first + second


def test_a_file_rewritten_under_the_same_name_is_uploaded_whole_not_from_the_stream(tmp_path):
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    ckpts = CheckpointStore(tmp_path / "src" / "job")
    old, new = os.urandom(2 * MB), os.urandom(2 * MB)
    streamer = t.stream("job", 1).start()
    try:
        ref = write_twice_under_one_name(ckpts, streamer, 3, old, new, _until,
                                         lambda: _size(_streamed(store, 1, 3)) == len(old))
        t.upload("job", 1, ref.path)
    finally:
        streamer.stop()
    assert (store / "job" / "ckpt-00000003" / "rank-0.pt").read_bytes() == new
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.rank_file(0).read_bytes() == new


KILLED_WRITER = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    from backend.agent.transfer import CheckpointTransfer
    from backend.proxy.checkpoint.store import CheckpointStore
    store, cache = sys.argv[1], Path(sys.argv[2])
    t = CheckpointTransfer(store, cache)
    t.fence("job", 1)
    t.stream("job", 1).start()
    def writer(f):
        f.write(b"a" * (4 << 20))   # the test hook sleeps after this first write
        f.write(b"b" * (4 << 20))
    CheckpointStore(cache / "job").write(8, 0, 1, writer)
    """)


def test_kill_9_half_way_through_a_streamed_write_leaves_the_previous_checkpoint_restorable(tmp_path):
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    before = os.urandom(MB)
    ref = CheckpointStore(tmp_path / "src" / "job").write(7, 0, 1, lambda f: f.write(before))
    t.upload("job", 1, ref.path)

    env = {**os.environ, SLEEP_HOOK_ENV: "60", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, store.as_uri(), str(tmp_path / "src")],
                            env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        _until(lambda: _size(_streamed(store, 1, 8)) == 4 * MB or proc.poll() is not None,
               "the killed writer's first half in the store")
        assert proc.poll() is None, "the writer ended before it was killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (store / "job" / "ckpt-00000008").exists()
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.step == 7 and restored.rank_file(0).read_bytes() == before

    # the next attempt (elsewhere) writes step 8 again: its bytes are published, the torn stream dropped
    t2 = CheckpointTransfer(store.as_uri(), tmp_path / "elsewhere")
    t2.fence("job", 2)
    after = os.urandom(MB)
    ref = CheckpointStore(tmp_path / "elsewhere" / "job").write(8, 0, 1, lambda f: f.write(after))
    t2.upload("job", 2, ref.path)
    assert not (store / "job" / STREAMS / "a1").exists()
    restored = _fetch(store, tmp_path / "dst2")
    assert restored is not None and restored.step == 8 and restored.rank_file(0).read_bytes() == after


def test_a_fenced_off_attempt_streams_nothing_that_reaches_a_checkpoint(tmp_path):
    store = tmp_path / "store"
    old = CheckpointTransfer(store.as_uri(), tmp_path / "zombie")
    old.fence("job", 1)
    streamer = old.stream("job", 1).start()
    new = CheckpointTransfer(store.as_uri(), tmp_path / "new")
    new.fence("job", 2)  # the zombie's node was presumed lost; attempt 2 started elsewhere
    good = os.urandom(MB)
    ref = CheckpointStore(tmp_path / "new" / "job").write(9, 0, 1, lambda f: f.write(good))
    new.upload("job", 2, ref.path)
    try:
        stale = CheckpointStore(tmp_path / "zombie" / "job").write(9, 0, 1, lambda f: f.write(os.urandom(MB)))
        with pytest.raises(StaleAttempt):
            old.upload("job", 1, stale.path)
    finally:
        streamer.stop()
    assert (store / "job" / "ckpt-00000009" / "rank-0.pt").read_bytes() == good
    assert not [p for p in (store / "job" / STREAMS).rglob("*") if p.is_file()]
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.rank_file(0).read_bytes() == good


def test_blobs_of_a_checkpoint_of_several_ranks_go_through_the_store(tmp_path):
    """Ranks of one node share big storages as blobs in a subfolder; the store must carry them."""
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    blob = os.urandom(MB)

    def part(rank):
        def writer(f):
            f.blob_dir.mkdir(exist_ok=True)
            h = digest.new()
            h.update(blob)
            (f.blob_dir / h.hexdigest()).write_bytes(blob)
            f.blobs[h.hexdigest()] = len(blob)
            f.write(f"rank {rank}".encode())
        return writer

    ckpts = CheckpointStore(tmp_path / "src" / "job")
    ckpts.write(5, 1, 2, part(1))
    ref = ckpts.write(5, 0, 2, part(0))
    t.upload("job", 1, ref.path)
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.step == 5 and len(restored.blobs) == 1
    assert (restored.blob_dir / next(iter(restored.blobs))).read_bytes() == blob


def test_a_store_copy_missing_a_file_is_not_fetched(tmp_path):
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    for step in (1, 2):
        ref = CheckpointStore(tmp_path / "src" / "job").write(step, 0, 1, lambda f: f.write(os.urandom(MB)))
        t.upload("job", 1, ref.path)
    with open(store / "job" / "ckpt-00000002" / "rank-0.pt", "r+b") as f:
        f.truncate(MB // 2)  # torn in the store
    restored = _fetch(store, tmp_path / "dst")
    assert restored is not None and restored.step == 1
    assert not (tmp_path / "dst" / "job" / "ckpt-00000002").exists()


def test_the_manifest_appears_in_the_store_whole_or_not_at_all(tmp_path, monkeypatch):
    """A reader (a download, a destination's prefetch) takes a manifest as soon as it sees one: on a
    filesystem store, a manifest copied in place could be read half-written and the checkpoint
    taken for damaged. Every byte of it is written under a hidden name, then renamed."""
    store = tmp_path / "store"
    t = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    t.fence("job", 1)
    final = store / "job" / "ckpt-00000001" / "manifest.json"
    put, seen = t.fs.put_file, []

    def put_file(lpath, rpath, *args, **kwargs):
        seen.append((os.path.basename(rpath), final.exists()))
        return put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(t.fs, "put_file", put_file)  # fsspec shares the instance: undone after
    ref = CheckpointStore(tmp_path / "src" / "job").write(1, 0, 1, lambda f: f.write(os.urandom(MB)))
    t.upload("job", 1, ref.path)
    assert ("manifest.json", False) not in seen and ("manifest.json", True) not in seen, seen
    assert (".manifest.json.part", False) in seen
    assert _fetch(store, tmp_path / "dst").step == 1
