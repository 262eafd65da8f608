"""What `singularityctl events` and the widget say of a start: the checkpoint's fetch, and how much
of it came while the source still wrote it only when some did (a plain resume prefetches nothing)."""
from __future__ import annotations

from singularity_sdk import EventType
from singularity_sdk.protocol import Event
from singularity_sdk.render import describe


def _started(**fetch) -> Event:
    return Event(job_id="j-1", seq=1, type=EventType.STARTED, time=0.0,
                 data={"node": "node-2", "ranks": [0], "pids": {"0": 42}, **fetch})


def test_a_start_says_how_its_checkpoint_was_fetched_and_what_came_early():
    assert describe(_started()) == "started on node-2: ranks [0], pids [42]"
    plain = describe(_started(fetch_s=0.045, prefetched_bytes=0))
    assert "checkpoint fetched in 45.0 ms" in plain and "while it was written" not in plain
    moved = describe(_started(fetch_s=0.002, prefetched_bytes=22_000_000))
    assert moved.endswith("checkpoint fetched in 2.0 ms, 22.0 MB of it while it was written"), moved


def test_blobs_a_move_did_not_carry_are_named():
    back = describe(_started(fetch_s=0.002, prefetched_bytes=0, linked_bytes=2_000_000))
    assert back.endswith("checkpoint fetched in 2.0 ms, 2.0 MB of unchanged blobs already here"), back
    ck = Event(job_id="j-1", seq=2, type=EventType.CHECKPOINTED, time=0.0,
               data={"step": 7, "bytes": 40_000, "seconds": 0.01, "wait_s": 0.002, "reused_bytes": 1_000_000})
    assert describe(ck).endswith("; 1.0 MB of unchanged blobs not uploaded again"), describe(ck)
