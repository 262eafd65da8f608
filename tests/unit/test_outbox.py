"""The agent's outbox: numbered, kept until acked, replayed after a reconnect, never twice."""
from singularity_sdk.protocol import EventType
from backend.agent.outbox import Outbox


def test_replay_after_reconnect_resends_only_unacked():
    box = Outbox()
    for i in range(5):
        box.add("j-1", 1, EventType.LOG, {"line": f"{i}\n"})
    first = box.take_unsent()
    assert [e.agent_seq for e in first] == [1, 2, 3, 4, 5]
    assert box.take_unsent() == []          # nothing is sent twice on one connection
    box.ack(2)
    box.connected(server_acked=3)           # the server committed 3 before it died
    assert [e.agent_seq for e in box.take_unsent()] == [4, 5]
    box.add("j-1", 1, EventType.LOG, {"line": "5\n"})
    assert [e.agent_seq for e in box.take_unsent()] == [6]
    box.ack(6)
    assert len(box) == 0 and box.jobs() == set()


def test_known_jobs_include_unacked_exits():
    box = Outbox()
    box.add("j-1", 2, EventType.WORKER_EXITED, {"rank": 0, "code": 0})
    assert box.jobs() == {("j-1", 2)}


def test_batches_are_bounded():
    box = Outbox()
    for i in range(1200):
        box.add("j", 1, EventType.LOG, {})
    sizes = []
    while batch := box.take_unsent():
        sizes.append(len(batch))
    assert sizes == [500, 500, 200]
