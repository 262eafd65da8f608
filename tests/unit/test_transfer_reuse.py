"""Unchanged blobs cross the store once (backend/agent/transfer.py, "Blobs are named by the
digest..."): an upload copies a blob an earlier checkpoint holds within the store, a download or
a prefetch links one the node's cache holds, and a blob that is not exactly the one named is
moved whole. Real parts: the checkpoint store's writer, a file:// fsspec store, caches of two
nodes, the prefetcher's thread."""
from __future__ import annotations

import os
from pathlib import Path

from backend.agent.prefetch import Prefetcher
from backend.agent.transfer import CheckpointTransfer
from backend.proxy.checkpoint import digest
from backend.proxy.checkpoint.store import CheckpointRef, CheckpointStore
from transfer_scenarios import until as _until

MB = 1 << 20


def _name(data: bytes) -> str:
    h = digest.new()
    h.update(data)
    return h.hexdigest()


def _writer(blobs: list[bytes], rank_bytes: bytes):
    """A rank's writer whose file references ``blobs`` (as a fine-tuning job's frozen weights
    are: the same bytes, the same digest, from one checkpoint to the next)."""
    def writer(f):
        f.blob_dir.mkdir(exist_ok=True)
        for blob in blobs:
            (f.blob_dir / _name(blob)).write_bytes(blob)
            f.blobs[_name(blob)] = len(blob)
        f.write(rank_bytes)
    return writer


def _write(cache: Path, step: int, blobs: list[bytes], rank_bytes: bytes, rank: int = 0,
           world_size: int = 1) -> CheckpointRef:
    return CheckpointStore(cache / "job").write(step, rank, world_size, _writer(blobs, rank_bytes))


def _spy(monkeypatch, method: str, t: CheckpointTransfer) -> list[str]:
    """Names of the files ``t.fs.<method>`` (put_file: sent to the store, get_file: fetched) moved
    (fsspec shares the instance: undone after)."""
    real, seen = getattr(t.fs, method), []

    def spy(src, dst, *args, **kwargs):
        seen.append(os.path.basename(dst if method == "put_file" else src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(t.fs, method, spy)
    return seen


def _ino(p: Path) -> int:
    return p.stat().st_ino


def test_an_unchanged_blob_is_copied_within_the_store_not_sent_again(tmp_path, monkeypatch):
    store = tmp_path / "store"
    src = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    src.fence("job", 1)
    frozen, head = os.urandom(3 * MB), os.urandom(MB)
    first = src.upload("job", 1, _write(tmp_path / "src", 1, [frozen, head], b"rank one").path)
    assert (first.sent_bytes, first.reused_bytes) == (4 * MB + len(b"rank one"), 0)

    sent = _spy(monkeypatch, "put_file", src)
    changed = os.urandom(MB)
    second = src.upload("job", 1, _write(tmp_path / "src", 2, [frozen, changed], b"rank two").path)
    assert second.reused_bytes == 3 * MB and second.sent_bytes == MB + len(b"rank two")
    assert _name(frozen) not in sent and _name(changed) in sent
    blob = f"blobs/{_name(frozen)}"
    assert _ino(store / "job" / "ckpt-00000002" / blob) == _ino(store / "job" / "ckpt-00000001" / blob)

    # a node with an empty cache gets the whole second checkpoint, every digest checked
    CheckpointTransfer(store.as_uri(), tmp_path / "dst").download("job")
    restored = CheckpointStore(tmp_path / "dst" / "job").latest(contents=True)
    assert restored is not None and restored.step == 2
    assert (restored.blob_dir / _name(frozen)).read_bytes() == frozen
    assert (restored.blob_dir / _name(changed)).read_bytes() == changed

    # once the first checkpoint is pruned, the second still holds its blob (the link's other name)
    for step in (3, 4):
        src.upload("job", 1, _write(tmp_path / "src", step, [os.urandom(MB)], b"later").path)
    assert not (store / "job" / "ckpt-00000002").exists()
    assert not (store / "job" / "ckpt-00000001").exists()


def test_a_download_links_the_blobs_its_cache_already_holds(tmp_path, monkeypatch):
    """A job that comes back to a node it left: the frozen weights of the checkpoint it wrote
    there are not fetched again."""
    store = tmp_path / "store"
    src, dst = CheckpointTransfer(store.as_uri(), tmp_path / "src"), CheckpointTransfer(store.as_uri(), tmp_path / "dst")
    src.fence("job", 1)
    frozen = os.urandom(2 * MB)
    src.upload("job", 1, _write(tmp_path / "src", 1, [frozen], b"one").path)
    dst.download("job")
    fetched = _spy(monkeypatch, "get_file", dst)
    changed = os.urandom(MB)
    src.upload("job", 1, _write(tmp_path / "src", 2, [frozen, changed], b"two").path)
    dst.download("job")
    cache = tmp_path / "dst" / "job"
    assert _name(frozen) not in fetched and _name(changed) in fetched and "rank-0.pt" in fetched
    blob = f"blobs/{_name(frozen)}"
    assert _ino(cache / "ckpt-00000002" / blob) == _ino(cache / "ckpt-00000001" / blob)
    restored = CheckpointStore(cache).latest(contents=True)
    assert restored is not None and restored.step == 2


def test_a_cached_blob_of_another_size_is_not_linked_but_fetched(tmp_path, monkeypatch):
    store = tmp_path / "store"
    src, dst = CheckpointTransfer(store.as_uri(), tmp_path / "src"), CheckpointTransfer(store.as_uri(), tmp_path / "dst")
    src.fence("job", 1)
    frozen = os.urandom(2 * MB)
    src.upload("job", 1, _write(tmp_path / "src", 1, [frozen], b"one").path)
    dst.download("job")
    with open(tmp_path / "dst" / "job" / "ckpt-00000001" / "blobs" / _name(frozen), "r+b") as f:
        f.truncate(MB)  # torn in this node's cache
    fetched = _spy(monkeypatch, "get_file", dst)
    src.upload("job", 1, _write(tmp_path / "src", 2, [frozen], b"two").path)
    dst.download("job")
    assert _name(frozen) in fetched
    ref = CheckpointStore(tmp_path / "dst" / "job").verify(tmp_path / "dst" / "job" / "ckpt-00000002", contents=True)
    assert (ref.blob_dir / _name(frozen)).read_bytes() == frozen


def test_without_reuse_every_blob_is_moved_whole(tmp_path, monkeypatch):
    """The baseline the benchmark compares with (`reuse_blobs=False`)."""
    store = tmp_path / "store"
    src = CheckpointTransfer(store.as_uri(), tmp_path / "src", reuse_blobs=False)
    dst = CheckpointTransfer(store.as_uri(), tmp_path / "dst", reuse_blobs=False)
    src.fence("job", 1)
    frozen = os.urandom(MB)
    src.upload("job", 1, _write(tmp_path / "src", 1, [frozen], b"one").path)
    dst.download("job")
    fetched = _spy(monkeypatch, "get_file", dst)
    second = src.upload("job", 1, _write(tmp_path / "src", 2, [frozen], b"two").path)
    dst.download("job")
    assert second.reused_bytes == 0 and _name(frozen) in fetched
    blob = f"blobs/{_name(frozen)}"
    assert _ino(store / "job" / "ckpt-00000002" / blob) != _ino(store / "job" / "ckpt-00000001" / blob)


def test_a_blob_pruned_from_the_store_meanwhile_is_sent(tmp_path):
    """The listing named an earlier checkpoint's blob, which is gone when the copy runs."""
    store = tmp_path / "store"
    src = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    src.fence("job", 1)
    frozen = os.urandom(MB)
    src.upload("job", 1, _write(tmp_path / "src", 1, [frozen], b"one").path)
    in_store = src.blobs_in_store("job")
    (store / "job" / "ckpt-00000001" / "blobs" / _name(frozen)).unlink()
    local = _write(tmp_path / "src", 2, [frozen], b"two").blob_dir / _name(frozen)
    target = store / "job" / "elsewhere"
    target.parent.mkdir(parents=True, exist_ok=True)
    assert src.put_blob(local, str(target), in_store) == MB
    assert target.read_bytes() == frozen


def test_the_prefetch_links_a_blob_its_cache_holds_and_copies_the_rest(tmp_path):
    store = tmp_path / "store"
    src, dst = CheckpointTransfer(store.as_uri(), tmp_path / "src"), CheckpointTransfer(store.as_uri(), tmp_path / "dst")
    src.fence("job", 1)
    frozen, changed = os.urandom(2 * MB), os.urandom(MB)
    src.upload("job", 1, _write(tmp_path / "src", 1, [frozen], b"one").path)
    dst.download("job")
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()
    _until(lambda: prefetch._after == 1, "the prefetch looking past the checkpoint it has")
    src.upload("job", 1, _write(tmp_path / "src", 2, [frozen, changed], b"two").path)
    cache = tmp_path / "dst" / "job"
    _until(lambda: (cache / "ckpt-00000002" / "manifest.json").exists(), "the checkpoint prefetched")
    early = prefetch.finish()
    assert set(early) == {2} and early[2] <= MB + len(b"two")  # the frozen blob was not copied
    blob = f"blobs/{_name(frozen)}"
    assert _ino(cache / "ckpt-00000002" / blob) == _ino(cache / "ckpt-00000001" / blob)
    assert CheckpointStore(cache).latest(contents=True).step == 2


def test_parts_of_a_spread_job_reuse_blobs_on_both_sides(tmp_path, monkeypatch):
    """Rank 1 on node B sends its part, rank 0's node A gathers it: a blob the store's committed
    checkpoint holds is copied there, one A's cache holds (and rank 0 did not write) is linked."""
    store = tmp_path / "store"
    a, b = CheckpointTransfer(store.as_uri(), tmp_path / "a"), CheckpointTransfer(store.as_uri(), tmp_path / "b")
    a.fence("job", 1)
    shared, own = os.urandom(2 * MB), os.urandom(MB)
    # an earlier checkpoint with both ranks on A, uploaded
    _write(tmp_path / "a", 1, [shared, own], b"r1", rank=1, world_size=2)
    a.upload("job", 1, _write(tmp_path / "a", 1, [shared], b"r0", rank=0, world_size=2).path)

    sender, gatherer = b.exchange("job", 1, 2, [1]), a.exchange("job", 1, 2, [0])
    sent, fetched = _spy(monkeypatch, "put_file", b), _spy(monkeypatch, "get_file", a)
    _write(tmp_path / "b", 2, [shared, own], b"r1 two", rank=1, world_size=2)
    sender.step()
    assert "rank-1.pt" in sent and _name(shared) not in sent and _name(own) not in sent
    _write(tmp_path / "a", 2, [shared], b"r0 two", rank=0, world_size=2)
    gatherer.step()
    committed = tmp_path / "a" / "job" / "ckpt-00000002"
    assert (committed / "manifest.json").exists() and "rank-1.pt" in fetched and _name(own) not in fetched
    assert _ino(committed / "blobs" / _name(own)) == _ino(tmp_path / "a" / "job" / "ckpt-00000001" / "blobs" / _name(own))
    ref = CheckpointStore(tmp_path / "a" / "job").verify(committed, contents=True)
    assert ref.rank_file(1).read_bytes() == b"r1 two"
