"""Every event real jobs produce fits its typed payload model (singularity_sdk/payloads.py):
a job that runs, checkpoints, is preempted, resumed, migrated and resized, one that fails, one
that is cancelled; and every event renders to a line (the CLI's and the widget's)."""
from __future__ import annotations

from exactness import source, wait_for_lines
from singularity_sdk import EventType, JobState
from singularity_sdk import payloads
from singularity_sdk.render import describe


def test_the_events_of_real_jobs_fit_their_payload_models(cluster):
    with cluster.client() as c:
        # long enough (~6 s of steps) that the preempt lands before the end on a loaded machine
        moved = c.submit(source("ddp_train.py"), filename="ddp_train.py", gpus=2, ranks=2, name="payloads",
                         checkpoint_every=0.5, env={"STEPS": "300"})
        wait_for_lines(moved, 3)
        moved.checkpoint(timeout=120)
        moved.preempt(timeout=120)
        moved.resume()
        wait_for_lines(moved, 1)
        moved.resize(1, timeout=120)
        moved.migrate(timeout=120)
        assert moved.wait(300) == JobState.SUCCEEDED, moved.refresh().info.error
        failed = c.submit("raise RuntimeError('boom')", name="fails")
        assert failed.wait(120) == JobState.FAILED
        cancelled = c.submit("import time\nwhile True:\n    time.sleep(0.05)", name="cancelled")
        wait_for_lines(cancelled, 0)
        cancelled.cancel()
        assert cancelled.wait(60) == JobState.CANCELLED
        events = [ev for job in (moved, failed, cancelled) for ev in job.events(follow=False)]
    seen = {ev.type for ev in events}
    assert seen >= {EventType.SUBMITTED, EventType.SCHEDULED, EventType.STARTED, EventType.LOG, EventType.CHECKPOINTED,
                    EventType.PREEMPTING, EventType.PREEMPTED, EventType.RESUMED, EventType.RESIZING, EventType.RESIZED,
                    EventType.MIGRATING, EventType.MIGRATED, EventType.WORKER_EXITED, EventType.RESULT,
                    EventType.SUCCEEDED, EventType.FAILED, EventType.CANCEL_REQUESTED, EventType.CANCELLED}, seen
    for ev in events:
        typed = payloads.of(ev)  # raises on a field of the wrong type
        assert isinstance(typed, payloads.MODELS[ev.type])
        line = describe(ev)
        assert line and not line.startswith(f"{ev.type.value} {{"), (ev.type, ev.data, line)
    migrated = next(payloads.of(ev) for ev in events if ev.type == EventType.MIGRATED)
    assert migrated.from_ and migrated.to and migrated.from_ != migrated.to
    resized = next(payloads.of(ev) for ev in events if ev.type == EventType.RESIZED)
    assert (resized.from_, resized.to) == (2, 1)
