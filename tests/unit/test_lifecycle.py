"""The lifecycle's rules, state by state: what a job becomes once its ranks exit, for every reason
its workers may be stopping and every kind of exit (backend/server/lifecycle.py)."""
from __future__ import annotations

import itertools
import json

import pytest

from backend.contract import EXIT_PREEMPTED
from backend.server.lifecycle import (
    MOVE_STATES,
    FollowUp,
    JobRecord,
    RetryPolicy,
    Stop,
    move_called_off,
    on_cancel,
    on_rank_exit,
    on_workers_lost,
    retry_or_fail,
)
from singularity_sdk.protocol import EventType, JobState

NOW = 1000.0
RETRY = RetryPolicy(max_retries=2, backoff_s=1.0, max_backoff_s=60.0)
CKPT = {"step": 7, "bytes": 123, "path": "/ckpt/ckpt-7"}
# exit kinds: finished, stopped at a checkpoint, the code raised, the process was killed
EXITS = {"finished": (0, False), "at_checkpoint": (EXIT_PREEMPTED, False), "raised": (1, True), "killed": (-9, False)}


def job(stop=None, ranks=1, state=JobState.RUNNING, **kw) -> JobRecord:
    if stop in MOVE_STATES and state == JobState.RUNNING:
        state = MOVE_STATES[stop]
    return JobRecord(id="j-1", state=state, ranks=ranks, attempt=2, stop=stop, started_at=NOW - 10,
                     last_checkpoint=CKPT, stop_detail=kw.pop("detail", {"reason": "test"}), **kw)


def exit_once(record: JobRecord, kind: str, rank: int = 0):
    code, user_error = EXITS[kind]
    return on_rank_exit(record, rank, code, NOW, RETRY, error="Traceback: boom" if user_error else None,
                        user_error=user_error)


def kinds(t) -> list[str]:
    return [f.kind for f in t.then]


# What a one-rank job becomes, by why it was stopping and how its rank exited.
EXPECTED = {
    (None, "finished"): JobState.SUCCEEDED,
    (None, "at_checkpoint"): JobState.QUEUED,  # its node's planned stop, or a SIGTERM: resumes later
    (None, "raised"): JobState.FAILED,
    (None, "killed"): JobState.QUEUED,  # retried
    (Stop.CANCEL, "finished"): JobState.CANCELLED,
    (Stop.CANCEL, "at_checkpoint"): JobState.CANCELLED,
    (Stop.CANCEL, "raised"): JobState.CANCELLED,
    (Stop.CANCEL, "killed"): JobState.CANCELLED,  # the stop signal itself
    (Stop.FAILED, "finished"): JobState.FAILED,
    (Stop.FAILED, "at_checkpoint"): JobState.FAILED,
    (Stop.FAILED, "raised"): JobState.FAILED,
    (Stop.FAILED, "killed"): JobState.FAILED,
    (Stop.CRASHED, "finished"): JobState.QUEUED,  # the first failure decided: a crash is retried
    (Stop.CRASHED, "at_checkpoint"): JobState.QUEUED,
    (Stop.CRASHED, "raised"): JobState.QUEUED,
    (Stop.CRASHED, "killed"): JobState.QUEUED,
    (Stop.PREEMPT, "finished"): JobState.SUCCEEDED,  # it ended before reaching a safe point
    (Stop.PREEMPT, "at_checkpoint"): JobState.PREEMPTED,
    (Stop.PREEMPT, "raised"): JobState.FAILED,
    (Stop.PREEMPT, "killed"): JobState.QUEUED,
    (Stop.MIGRATE, "finished"): JobState.SUCCEEDED,
    (Stop.MIGRATE, "at_checkpoint"): None,  # stays MIGRATING: placed again by the follow-up
    (Stop.MIGRATE, "raised"): JobState.FAILED,
    (Stop.MIGRATE, "killed"): JobState.QUEUED,
    (Stop.RESIZE, "finished"): JobState.SUCCEEDED,
    (Stop.RESIZE, "at_checkpoint"): None,
    (Stop.RESIZE, "raised"): JobState.FAILED,
    (Stop.RESIZE, "killed"): JobState.QUEUED,
}


def test_the_table_covers_every_reason_and_every_exit():
    assert set(EXPECTED) == set(itertools.product([None, *Stop], EXITS))


@pytest.mark.parametrize("stop,kind", sorted(EXPECTED, key=lambda k: (str(k[0]), k[1])))
def test_a_one_rank_job_settles_by_why_it_stopped(stop, kind):
    t = exit_once(job(stop), kind)
    assert t.state == EXPECTED[(stop, kind)], (stop, kind, t.updates)
    assert t.updates["stop_reason"] is None, "a settled job has no stop under way"
    assert kinds(t)[-1] == "schedule", "devices were freed: the scheduler runs"
    if t.state is not None and t.state.is_terminal:
        assert t.updates["ended_at"] == NOW
    if t.state == JobState.QUEUED and (stop, kind) != (None, "at_checkpoint"):
        assert t.updates["retries"] == 1 and t.updates["not_before"] == NOW + 1.0
        assert [e for e, _ in t.events] == [EventType.RETRYING] and "wake_at" in kinds(t)
    if t.state == JobState.FAILED and stop is None:
        assert t.updates["error"] == "Traceback: boom" and t.events == [(EventType.FAILED, {"error": "Traceback: boom"})]
    if (stop, kind) == (Stop.PREEMPT, "at_checkpoint"):
        assert t.events == [(EventType.PREEMPTED, {"reason": "test", "step": 7, "bytes": 123,
                                                   "checkpoint": "/ckpt/ckpt-7"})]
    if (stop, kind) in ((Stop.MIGRATE, "at_checkpoint"), (Stop.RESIZE, "at_checkpoint")):
        assert kinds(t) == [f"{stop.value}_onwards", "schedule"] and t.events == []
        assert t.then[0].detail == {"reason": "test"}


def test_the_first_failure_decides_and_stops_the_other_ranks():
    t = exit_once(job(ranks=3), "raised", rank=1)
    assert t.state is None, "two ranks still run"
    assert t.updates["stop_reason"] == Stop.FAILED.value and t.updates["error"] == "Traceback: boom"
    assert t.then == [FollowUp("stop_everywhere", why="rank 1 failed")]
    assert json.loads(t.updates["exited_json"]) == {"1": 1}
    # the others die from the stop signal: the job fails with the first error, once
    after = job(Stop.FAILED, ranks=3, exited={1: 1}, error="Traceback: boom")
    t2 = exit_once(after, "killed", rank=0)
    assert t2.state is None and "stop_reason" not in t2.updates and t2.then == []
    t3 = exit_once(JobRecord(**{**after.__dict__, "exited": {1: 1, 0: -9}}), "killed", rank=2)
    assert t3.state == JobState.FAILED and t3.events == [(EventType.FAILED, {"error": "Traceback: boom"})]


def test_a_crash_during_a_move_turns_the_move_into_a_retry():
    t = exit_once(job(Stop.MIGRATE, ranks=2), "killed", rank=0)
    assert t.updates["stop_reason"] == Stop.CRASHED.value and t.then[0].kind == "stop_everywhere"


@pytest.mark.parametrize("codes", list(itertools.product([0, EXIT_PREEMPTED], repeat=2)))
def test_a_two_rank_preemption_needs_a_checkpoint_from_some_rank(codes):
    record = job(Stop.PREEMPT, ranks=2, exited={0: codes[0]})
    t = on_rank_exit(record, 1, codes[1], NOW, RETRY)
    expected = JobState.PREEMPTED if EXIT_PREEMPTED in codes else JobState.SUCCEEDED
    assert t.state == expected


def test_a_stop_nobody_here_asked_for_queues_the_job_again():
    t = on_rank_exit(job(), 0, EXIT_PREEMPTED, NOW, RETRY, planned="the node agent is stopping")
    assert t.state == JobState.QUEUED and "ended_at" not in t.updates
    assert t.events == [(EventType.PREEMPTED, {"reason": "the node agent is stopping", "by": "node", "requeue": True,
                                               "step": 7, "bytes": 123, "checkpoint": "/ckpt/ckpt-7"})]
    assert "SIGTERM" in exit_once(job(), "at_checkpoint").events[0][1]["reason"]


def test_requeue_preemptions_go_back_to_the_queue():
    t = exit_once(job(Stop.PREEMPT, detail={"requeue": True, "reason": "scheduler"}), "at_checkpoint")
    assert t.state == JobState.QUEUED and t.events[0][0] == EventType.PREEMPTED


def test_retries_back_off_and_give_up():
    first = retry_or_fail(job(retries=0), "node lost", NOW, RETRY)
    assert first.state == JobState.QUEUED and first.updates["not_before"] == NOW + 1.0
    assert first.events[0][1] == {"attempt": 3, "why": "node lost", "retries": 1, "backoff_s": 1.0, "from_step": 7}
    second = retry_or_fail(job(retries=1), "node lost", NOW, RETRY)
    assert second.updates["not_before"] == NOW + 2.0
    last = retry_or_fail(job(retries=2), "node lost", NOW, RETRY)
    assert last.state == JobState.FAILED and "gave up after 2 retries" in last.updates["error"]
    capped = retry_or_fail(job(retries=10), "x", NOW, RetryPolicy(max_retries=99, backoff_s=1.0, max_backoff_s=5.0))
    assert capped.updates["not_before"] == NOW + 5.0


def test_lost_workers_of_a_cancelled_job_end_it_and_others_retry():
    assert on_workers_lost(job(Stop.CANCEL), "node lost", NOW, RETRY).state == JobState.CANCELLED
    lost = on_workers_lost(job(Stop.PREEMPT), "node lost", NOW, RETRY)
    assert lost.state == JobState.QUEUED and lost.updates["stop_reason"] is None and kinds(lost)[-1] == "schedule"


@pytest.mark.parametrize("stop", [None, *Stop])
def test_a_failed_checkpoint_calls_off_moves_only(stop):
    updates = move_called_off(job(stop, detail={"request_was": 4} if stop == Stop.RESIZE else {}))
    if stop in (Stop.PREEMPT, Stop.MIGRATE, Stop.RESIZE):
        assert updates["state"] == JobState.RUNNING.value and updates["stop_reason"] is None
        assert updates.get("gpus") == (4 if stop == Stop.RESIZE else None)
    else:
        assert updates == {}


@pytest.mark.parametrize("state", list(JobState))
def test_cancel_in_every_state(state):
    record = job(state=state)
    data = {"by": "alice", "reason": "test"}
    if state.is_terminal:
        with pytest.raises(ValueError, match="nothing to cancel"):
            on_cancel(record, NOW, data)
        return
    t = on_cancel(record, NOW, data)
    if state.holds_devices:
        assert t.updates["stop_reason"] == "cancel" and t.events == [(EventType.CANCEL_REQUESTED, data)]
        assert t.state == (JobState.RUNNING if state == JobState.PREEMPTING else state)
        assert kinds(t) == ["stop_everywhere"]
    else:
        assert t.state == JobState.CANCELLED and t.events == [(EventType.CANCELLED, data)]
    again = on_cancel(job(Stop.CANCEL, state=state), NOW, data) if state.holds_devices else None
    if again is not None:
        assert again.updates == {} and again.events == [], "a second cancel only repeats the stop"


def test_a_row_decodes_once():
    row = {"id": "j-9", "state": "resizing", "ranks": 4, "attempt": 3, "stop_reason": "resize",
           "stop_detail_json": '{"request_was": 2}', "exited_json": '{"0": 75}', "error": None, "retries": 1,
           "started_at": 5.0, "last_checkpoint_json": '{"step": 3}'}
    record = JobRecord.from_row(row)
    assert record.stop == Stop.RESIZE and record.exited == {0: 75} and record.stop_detail == {"request_was": 2}
    assert record.last_checkpoint == {"step": 3} and record.state == JobState.RESIZING


def test_an_exit_from_a_rank_the_job_does_not_have_is_refused():
    with pytest.raises(ValueError, match="rank below 1"):
        on_rank_exit(job(), 3, 0, NOW, RETRY)
