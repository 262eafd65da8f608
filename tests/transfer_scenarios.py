"""What the store's transfer tests share: waiting for a background thread, and a checkpoint written
twice under the same name while the source's streamer sleeps (the streaming and prefetch tests
must never restore the first try)."""
from __future__ import annotations

import time
from typing import Callable

import pytest

from backend.agent.transfer import Streamer
from backend.proxy.checkpoint.store import CheckpointRef, CheckpointStore


def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait for ``cond`` (a liveness bound, not a timing claim)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"still not: {what}")
        time.sleep(0.005)


def write_twice_under_one_name(ckpts: CheckpointStore, streamer: Streamer, step: int, old: bytes, new: bytes,
                               until: Callable[[Callable[[], bool], str], None],
                               first_try_seen: Callable[[], bool]) -> CheckpointRef:
    """The first write of ``step`` puts ``old`` in its rank file and fails once ``first_try_seen()``;
    the retry writes ``new`` (the same size: only the file and the digest tell) while the streamer
    is held, so its copy is still the first try's. Returns the committed checkpoint."""

    def fails(f):
        f.write(old)
        f.flush()
        until(first_try_seen, "the first try copied")
        streamer._lock.acquire()  # the streamer sleeps through the retry: it still holds the old file
        raise RuntimeError("the write failed half-way")

    with pytest.raises(RuntimeError):
        ckpts.write(step, 0, 1, fails)
    try:
        return ckpts.write(step, 0, 1, lambda f: f.write(new))
    finally:
        streamer._lock.release()
