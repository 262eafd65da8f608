"""The agent's outbox: numbered, kept until acked, replayed after a reconnect, never twice."""
from singularity_sdk.protocol import EventType
from backend.agent.outbox import LOG_EVENT_CHARS, Outbox


def test_replay_after_reconnect_resends_only_unacked():
    box = Outbox()
    for i in range(5):
        box.add("j-1", 1, EventType.PROGRESS, {"step": i})
    first = box.take_unsent()
    assert [e.agent_seq for e in first] == [1, 2, 3, 4, 5]
    assert box.take_unsent() == []          # nothing is sent twice on one connection
    box.ack(2)
    box.connected(server_acked=3)           # the server committed 3 before it died
    assert [e.agent_seq for e in box.take_unsent()] == [4, 5]
    box.add("j-1", 1, EventType.PROGRESS, {"step": 5})
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
        box.add("j", 1, EventType.PROGRESS, {"step": i})
    sizes = []
    while batch := box.take_unsent():
        sizes.append(len(batch))
    assert sizes == [500, 500, 200]


def _line(text: str, rank: int = 0, stream: str = "stdout") -> dict:
    return {"rank": rank, "stream": stream, "line": text}


def test_lines_waiting_to_be_sent_join_one_event_but_never_a_sent_one():
    box = Outbox()
    box.add("j", 1, EventType.LOG, _line("a\n"))
    box.add("j", 1, EventType.LOG, _line("b\n"))
    sent = box.take_unsent()
    assert [(e.agent_seq, e.data["line"]) for e in sent] == [(1, "a\nb\n")]
    box.add("j", 1, EventType.LOG, _line("c\n"))  # the sent event stays as it was sent
    assert sent[0].data["line"] == "a\nb\n"
    assert [(e.agent_seq, e.data["line"]) for e in box.take_unsent()] == [(2, "c\n")]


def test_lines_do_not_join_across_another_event_rank_stream_attempt_or_a_partial_line():
    box = Outbox()
    box.add("j", 1, EventType.LOG, _line("a\n"))
    box.add("j", 1, EventType.CHECKPOINT_STARTED, {"rank": 0, "step": 1})
    box.add("j", 1, EventType.LOG, _line("b\n"))
    box.add("j", 1, EventType.LOG, _line("c\n", rank=1))
    box.add("j", 1, EventType.LOG, _line("d\n", rank=1, stream="stderr"))
    box.add("j", 2, EventType.LOG, _line("e\n", rank=1, stream="stderr"))
    box.add("j", 2, EventType.LOG, _line("piece", rank=1, stream="stderr"))
    box.add("j", 2, EventType.LOG, _line(" rest\n", rank=1, stream="stderr"))
    assert [e.data.get("line") for e in box.take_unsent()] == ["a\n", None, "b\n", "c\n", "d\n", "e\npiece", " rest\n"]


def test_a_joined_event_stays_within_its_size():
    box = Outbox()
    line = "x" * 1000 + "\n"
    for _ in range(200):
        box.add("j", 1, EventType.LOG, _line(line))
    texts = [e.data["line"] for e in box.take_unsent()]
    assert "".join(texts) == line * 200 and max(map(len, texts)) <= LOG_EVENT_CHARS and len(texts) == 4
