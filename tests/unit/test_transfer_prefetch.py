"""A migration's destination copies the checkpoint while the source still writes and uploads it
(backend/agent/prefetch.py, `Prefetcher`), and installs only exactly the committed bytes.

Real parts throughout: the checkpoint store's own writer, a file:// fsspec store, the source's
streamer thread and the destination's prefetcher thread, each with a cache of its own."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from backend.agent.prefetch import Prefetcher
from backend.agent.transfer import CheckpointTransfer
from backend.proxy.checkpoint.store import CheckpointStore
from transfer_scenarios import until as _until
from transfer_scenarios import write_twice_under_one_name

MB = 1 << 20


def _prefetched(cache: Path, step: int) -> Path:
    return cache / "job" / f".ckpt-{step:08d}.prefetch" / "rank-0.pt"


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else -1


def _pair(tmp_path: Path) -> tuple[Path, CheckpointTransfer, CheckpointTransfer]:
    store = tmp_path / "store"
    src = CheckpointTransfer(store.as_uri(), tmp_path / "src")
    src.fence("job", 1)
    return store, src, CheckpointTransfer(store.as_uri(), tmp_path / "dst")


def _restored(cache: Path, transfer: CheckpointTransfer, upto: int):
    """What the destination restores at the start: download (which finds the prefetched copy),
    then the newest checkpoint that verifies with every file hashed."""
    transfer.download("job", upto=upto)
    return CheckpointStore(cache / "job").latest(contents=True)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed-upload", "upload-after-commit"])
def test_the_destination_copies_the_checkpoint_while_the_source_still_writes_it(tmp_path, streamed):
    store, src, dst = _pair(tmp_path)
    first, second = os.urandom(3 * MB), os.urandom(2 * MB)
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()

    def writer(f):
        f.write(first)
        f.flush()
        if streamed:  # the destination holds the first half while the source has not written the second
            _until(lambda: _size(_prefetched(tmp_path / "dst", 7)) == len(first), "the written half prefetched")
        f.write(second)

    streamer = src.stream("job", 1).start() if streamed else None
    try:
        ref = CheckpointStore(tmp_path / "src" / "job").write(7, 0, 1, writer)
        src.upload("job", 1, ref.path)
    finally:
        if streamer is not None:
            streamer.stop()
    installed = tmp_path / "dst" / "job" / "ckpt-00000007" / "rank-0.pt"
    # in the background, before the job starts here: the checkpoint is in the cache, checked
    _until(lambda: installed.exists(), "the prefetched checkpoint installed by the thread")
    early = prefetch.finish()
    assert set(early) == {7}
    if streamed:
        assert early[7] >= len(first)
    inode = installed.stat().st_ino
    restored = _restored(tmp_path / "dst", dst, 7)
    assert restored is not None and restored.step == 7
    assert restored.rank_file(0).read_bytes() == first + second
    assert installed.stat().st_ino == inode, "the start used the prefetched copy, it did not fetch again"
    assert not list((tmp_path / "dst" / "job").glob(".*prefetch"))


def test_a_prefetched_copy_of_bytes_the_source_rewrote_is_fetched_again_whole(tmp_path):
    store, src, dst = _pair(tmp_path)
    ckpts = CheckpointStore(tmp_path / "src" / "job")
    old, new = os.urandom(2 * MB), os.urandom(2 * MB)
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()
    streamer = src.stream("job", 1).start()
    try:
        ref = write_twice_under_one_name(ckpts, streamer, 3, old, new, _until,
                                         lambda: _size(_prefetched(tmp_path / "dst", 3)) == len(old))
        src.upload("job", 1, ref.path)
    finally:
        streamer.stop()
    assert set(prefetch.finish()) == {3}
    restored = _restored(tmp_path / "dst", dst, 3)
    assert restored is not None and restored.rank_file(0).read_bytes() == new


def test_a_checkpoint_that_never_commits_leaves_nothing_and_older_ones_are_not_followed(tmp_path):
    store, src, dst = _pair(tmp_path)
    ckpts = CheckpointStore(tmp_path / "src" / "job")
    before = os.urandom(MB)
    src.upload("job", 1, ckpts.write(4, 0, 1, lambda f: f.write(before)).path)
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()
    streamer = src.stream("job", 1).start()

    def fails(f):
        f.write(os.urandom(2 * MB))
        f.flush()
        _until(lambda: _size(_prefetched(tmp_path / "dst", 5)) > 0, "the doomed write prefetched")
        raise RuntimeError("the source died mid-write")

    try:
        with pytest.raises(RuntimeError):
            ckpts.write(5, 0, 1, fails)
    finally:
        streamer.stop()
    assert prefetch.finish() == {}, "step 4 was complete before the prefetch began; step 5 never was"
    assert not list((tmp_path / "dst" / "job").glob("*ckpt*")), "nothing half-copied stays in the cache"
    restored = _restored(tmp_path / "dst", dst, 4)
    assert restored is not None and restored.step == 4 and restored.rank_file(0).read_bytes() == before


def test_a_copy_damaged_in_the_store_is_installed_as_it_is_there_and_refused_at_the_restore(tmp_path):
    """The prefetch neither hides nor mends damage: it installs what the store holds (as a plain
    download would), and the restore's digest check refuses it."""
    store, src, dst = _pair(tmp_path)
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()
    good = os.urandom(MB)
    local = CheckpointStore(tmp_path / "src" / "job").write(6, 0, 1, lambda f: f.write(good)).path
    remote = store / "job" / local.name
    remote.mkdir(parents=True)
    (remote / "rank-0.pt").write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])  # same size, one byte flipped
    # last and whole, as an upload does (written in place, the poller could read it half written)
    (remote / "manifest.tmp").write_bytes((local / "manifest.json").read_bytes())
    os.replace(remote / "manifest.tmp", remote / "manifest.json")
    assert set(prefetch.finish()) == {6}
    installed = tmp_path / "dst" / "job" / local.name
    assert installed.joinpath("rank-0.pt").read_bytes() == (remote / "rank-0.pt").read_bytes()
    with pytest.warns(UserWarning, match="damaged"):
        assert CheckpointStore(tmp_path / "dst" / "job").latest(contents=True) is None


def test_a_manifest_seen_half_written_is_read_again_not_given_up(tmp_path, caplog):
    """A store may show a file while it is written: the poller reads the manifest again next turn
    (giving the checkpoint up would make the start download it all)."""
    store, src, dst = _pair(tmp_path)
    caplog.set_level(logging.INFO, logger="singularity.agent")
    prefetch = Prefetcher(dst, "job", 1, poll_s=0.005).start()
    good = os.urandom(MB)
    local = CheckpointStore(tmp_path / "src" / "job").write(6, 0, 1, lambda f: f.write(good)).path
    remote = store / "job" / local.name
    remote.mkdir(parents=True)
    (remote / "rank-0.pt").write_bytes(good)
    manifest = (local / "manifest.json").read_bytes()
    (remote / "manifest.json").write_bytes(manifest[: len(manifest) // 2])
    _until(lambda: "checkpoint 6 of job" in caplog.text, "the half-written manifest seen by the poller")
    (remote / "manifest.json").write_bytes(manifest)
    installed = tmp_path / "dst" / "job" / local.name / "rank-0.pt"
    _until(installed.exists, "the checkpoint installed once its manifest was whole")
    assert set(prefetch.finish()) == {6}
    restored = _restored(tmp_path / "dst", dst, 6)
    assert restored is not None and restored.rank_file(0).read_bytes() == good
