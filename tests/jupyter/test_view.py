"""Every event type of the protocol is rendered, by the view model, the widget and the text output,
including those that no backend feature emits yet (migration, resize, node loss)."""
from __future__ import annotations

import io
import time

import pytest

from jupyter_ext.text import TextPrinter
from jupyter_ext.view import QUIET, JobView
from singularity_sdk.protocol import Event, EventType, JobInfo, JobState

P1 = [{"node": "node-1", "devices": [0, 1], "ranks": [0, 1, 2, 3]}]
P2 = [{"node": "node-2", "devices": [0], "ranks": [0, 1, 2, 3]}]

#: One realistic event of every type, in the order a preempted, migrated, resized job sees them.
STORY = [
    (EventType.SUBMITTED, {"user": "ada", "name": "finetune", "gpus": 4, "ranks": 4, "sla": "basic", "kind": "source"}),
    (EventType.SCHEDULED, {"attempt": 1, "placement": P1, "reason": "fifo"}),
    (EventType.RENDEZVOUS, {"node": "node-1", "port": 41234}),
    (EventType.STARTED, {"node": "node-1", "ranks": [0, 1], "pids": {"0": 11, "1": 12}, "devices": [0, 1], "attempt": 1}),
    (EventType.INTERRUPTIBLE, {"interruptible": False, "safe_points": [], "not_safe_points": [
        {"line": 3, "kind": "for", "function": "main"}], "called_from": {"main": [9]},
        "message": "no safe point: the loops at train.py line(s) 3 (in main) run inside functions called from line(s) 9"}),
    (EventType.EXACTNESS, {"fingerprint": {"python": "3.11.7", "torch": "2.4.0", "device": "NVIDIA H200"},
                           "warnings": ["torch.backends.cudnn.benchmark is on"]}),
    (EventType.LOG, {"rank": 0, "stream": "stdout", "line": "epoch 0\n"}),
    (EventType.LOG, {"rank": 1, "stream": "stderr", "line": "warning: slow\n"}),
    (EventType.PROGRESS, {"step": 10, "loops": [10]}),
    (EventType.TELEMETRY, {"devices": []}),
    (EventType.PROGRESS, {"step": 30, "loops": [30]}),
    (EventType.CHECKPOINT_STARTED, {"reason": "periodic"}),
    (EventType.CHECKPOINTED, {"step": 30, "bytes": 2_500_000, "seconds": 0.4, "wait_s": 0.01, "path": "/c/1"}),
    (EventType.PREEMPTING, {"reason": "premium job needs devices", "by": "scheduler"}),
    (EventType.CHECKPOINT_FAILED, {"error": "socket 'conn' cannot be saved", "variables": [["conn", "socket"]]}),
    (EventType.PREEMPTING, {"reason": "premium job needs devices", "by": "scheduler"}),
    (EventType.PREEMPTED, {"reason": "premium job needs devices", "by": "scheduler", "step": 31}),
    (EventType.RESUMED, {"step": 31, "placement": P1, "attempt": 2}),
    (EventType.MIGRATING, {"from": "node-1", "reason": "defragmentation"}),
    (EventType.MIGRATED, {"from": "node-1", "to": "node-2", "seconds": 1.5, "placement": P2}),
    (EventType.RESIZING, {"from": 1, "to": 2, "reason": "devices freed"}),
    (EventType.RESIZED, {"from": 1, "to": 2, "splicing": 2, "seconds": 0.9, "placement": P1}),
    (EventType.NODE_LOST, {"node": "node-1", "silent_s": 10.2}),
    (EventType.RETRYING, {"attempt": 3, "why": "node lost", "retries": 1}),
    # rank 1's line (seq 7) was printed after the checkpoint attempt 3 restores: printed again
    (EventType.SUPERSEDED, {"attempt": 3, "ranks": [1], "after_seq": 6, "before_seq": 25, "lines": 1}),
    (EventType.SCHEDULED, {"attempt": 3, "placement": P2, "reason": "fifo"}),
    (EventType.CANCEL_REQUESTED, {"by": "ada", "reason": "enough"}),
    (EventType.RESULT, {"repr": "0.25", "bytes": 21, "error": None}),
    (EventType.WORKER_EXITED, {"node": "node-2", "rank": 0, "code": -15, "signal": "SIGTERM"}),
    (EventType.CANCELLED, {"by": "ada", "reason": "workers stopped"}),
]
# Terminal types that do not fit the story above.
OTHER_ENDS = [(EventType.SUCCEEDED, {"seconds": 12.5}),
              (EventType.FAILED, {"error": "Traceback...\nValueError: bad batch"})]


def info(**kw) -> JobInfo:
    base = dict(id="j-000001", name="finetune", user="ada", state="queued", sla="basic", gpus=4, ranks=4,
                created_at=time.time(), updated_at=time.time())
    return JobInfo(**{**base, **kw})


def events(pairs, start=1):
    t = time.time()
    return [Event(job_id="j-000001", seq=start + i, type=t_, time=t + i * 0.1, data=d) for i, (t_, d) in enumerate(pairs)]


def test_story_covers_every_event_type():
    assert {t for t, _ in STORY + OTHER_ENDS} == set(EventType)


def test_view_follows_the_story():
    view = JobView(info())
    evs = events(STORY)
    states = []
    for ev in evs:
        view.apply([ev])
        states.append(view.state)
    idx = {t: i for i, (t, _) in enumerate(STORY)}
    assert states[idx[EventType.SCHEDULED]] == JobState.RUNNING
    assert states[idx[EventType.CHECKPOINT_FAILED]] == JobState.RUNNING  # a refused preemption: runs on
    assert states[idx[EventType.PREEMPTED]] == JobState.PREEMPTED
    assert states[idx[EventType.MIGRATING]] == JobState.MIGRATING
    assert states[idx[EventType.RESIZED]] == JobState.RUNNING
    assert states[idx[EventType.RETRYING]] == JobState.QUEUED
    assert view.state == JobState.CANCELLED and view.finished and view.placement == []
    assert view.step == 31 and view.log_lines == 1 and view.splicing == 2
    assert list(view.logs) == ["[rank 0] epoch 0"]  # rank 1's line was superseded
    shown = {e.type for e in view.timeline}
    assert shown == {t for t, _ in STORY} - QUIET
    texts = "\n".join(e.text for e in view.timeline)
    for needle in ("checkpointed at step 30: 2.5 MB", "preempted at step 31", "migrated node-1 -> node-2",
                   "resized 1 -> 2 devices (2 rank(s) per device)", "node node-1 lost", "retrying as attempt 3"):
        assert needle in texts
    assert not view.apply(evs)  # duplicates (a reconnect's replay) change nothing


def test_progress_rate_placement_and_info_updates():
    view = JobView(info())
    view.apply(events(STORY[:3]))
    assert view.placement_text() == "node-1 [0, 1] - 4 rank(s) on 2 device(s), splicing x2"
    t0 = time.time()
    view.apply([Event(job_id="j-000001", seq=10, type=EventType.PROGRESS, time=t0, data={"step": 100}),
                Event(job_id="j-000001", seq=11, type=EventType.PROGRESS, time=t0 + 2, data={"step": 150})])
    assert view.step == 150 and view.rate == pytest.approx(25.0)
    assert "step 150 - 25.0 it/s" in view.progress_text()
    # A resume is answered with "queued" and emits no event; older answers never win over events.
    assert not view.update_info(info(state="succeeded", last_seq=5))
    assert view.update_info(info(state="queued", last_seq=11)) and view.state == JobState.QUEUED


def test_widget_renders_every_event_type():
    from jupyter_ext.widgets import JobWidget

    class NoServer:
        def nodes(self):
            raise OSError("no server in this test")

    w = JobWidget(NoServer(), info())  # type: ignore[arg-type]
    w.on_events(events(STORY))
    for t, _ in STORY:
        if t not in QUIET:
            assert f">{t.value}</td>" in w.timeline.value, t
    assert "cancelled" in w.header.value and "epoch 0" in w.logs.value
    # what a user should know before the first preemption stays in view, not only in the timeline
    assert "no safe point: the loops at train.py line(s) 3 (in main)" in w.progress.value
    assert "cudnn.benchmark is on" in w.progress.value
    assert all(b.disabled for b in w.buttons.values())
    assert w._repr_mimebundle_()["text/plain"].startswith("finetune (j-000001): cancelled")
    for end, data in OTHER_ENDS:
        w2 = JobWidget(NoServer(), info())  # type: ignore[arg-type]
        w2.on_events(events(STORY[:3] + [(end, data)]))
        assert f">{end.value}</td>" in w2.timeline.value
    assert "ValueError: bad batch" in w2.message.value


def test_text_output_prints_logs_raw_and_events_as_lines():
    from singularity_sdk.render import describe

    out, err = io.StringIO(), io.StringIO()
    p = TextPrinter("j-000001", ranks=4, events=True, out=out, err=err)
    evs = events(STORY + OTHER_ENDS)
    p.show(evs)
    text = out.getvalue()
    assert "[rank 0] epoch 0\n" in text and "[rank 1] warning: slow\n" in err.getvalue()
    quiet = (EventType.LOG, EventType.PROGRESS, EventType.TELEMETRY, EventType.RESULT)
    lines = [ln for ln in text.splitlines() if ln.startswith("[singularity j-000001 ")]
    assert [ln.split("] ", 1)[1] for ln in lines] == [describe(ev) for ev in evs if ev.type not in quiet]


def test_text_output_holds_back_the_failing_traceback():
    tb = ["Traceback (most recent call last):\n", '  File "<cell>", line 1, in <module>\n', "ZeroDivisionError: x\n"]
    failing = [(EventType.LOG, {"rank": 0, "stream": "stderr", "line": line}) for line in tb]
    out, err = io.StringIO(), io.StringIO()
    p = TextPrinter("j-1", ranks=1, events=False, out=out, err=err)
    p.show(events(failing))
    p.finish(failed=True)
    assert err.getvalue() == ""  # shown once, as the cell's error
    out, err = io.StringIO(), io.StringIO()
    p = TextPrinter("j-1", ranks=1, events=False, out=out, err=err)
    p.show(events(failing + [(EventType.LOG, {"rank": 0, "stream": "stdout", "line": "recovered\n"})]))
    p.finish(failed=False)
    assert err.getvalue() == "".join(tb) and out.getvalue() == "recovered\n"
