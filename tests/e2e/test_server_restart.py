"""``kill -9`` the server mid-job, restart it on the same home: the job completes, the log is whole."""
from __future__ import annotations

import time

from singularity_sdk import EventType, JobState


def test_server_kill9_and_restart_loses_no_event(fresh_cluster):
    cluster = fresh_cluster
    client = cluster.client()
    job = client.submit("import time\nfor i in range(40):\n    print('tick', i, flush=True)\n    time.sleep(0.05)\n'done'")
    for ev in job.events():
        if ev.type == EventType.LOG:
            break
    agents_before = cluster.agent_pids()
    cluster.kill_server()
    time.sleep(1.0)  # the job keeps printing into the agent's buffer meanwhile
    cluster.restart_server()
    assert cluster.agent_pids() == agents_before  # the same agents reconnected, none duplicated
    client = cluster.client()
    job = client.get(job.id)
    assert job.wait(60) == JobState.SUCCEEDED
    assert job.result() == "done"
    events = list(job.events(follow=False))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    ticks = [line for e in events for line in e.lines]
    assert ticks == [f"tick {i}\n" for i in range(40)]
    assert sum(e.type == EventType.SUCCEEDED for e in events) == 1
    assert sum(e.type == EventType.STARTED for e in events) == 1  # never restarted
    # The restarted server schedules new work as before.
    assert client.submit("1 + 1").result(timeout=60) == 2
    client.close()


def test_restart_keeps_tokens_and_history(fresh_cluster):
    cluster = fresh_cluster
    token = cluster.token
    with cluster.client() as client:
        done = client.submit("'kept'")
        assert done.result(timeout=60) == "kept"
    cluster.kill_server()
    cluster.restart_server()
    assert cluster.token == token
    with cluster.client() as client:
        assert client.get(done.id).result() == "kept"


def test_job_follow_carries_on_across_a_server_restart(fresh_cluster):
    """``Job.follow`` reconnects from the last event it saw: every event once, in order."""
    import threading

    cluster = fresh_cluster
    client = cluster.client()
    job = client.submit("import time\nfor i in range(40):\n    print('tick', i, flush=True)\n    time.sleep(0.05)\n'done'")
    seen: list = []
    first_line = threading.Event()

    def follow() -> None:
        for batch in job.follow(tick_s=0.2):
            seen.extend(batch)
            if any(e.type == EventType.LOG for e in batch):
                first_line.set()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert first_line.wait(60)
    cluster.kill_server()
    time.sleep(1.0)
    cluster.restart_server()
    follower.join(90)
    assert not follower.is_alive(), "follow() ends with the job"
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1)), "each event once, in order"
    assert seen[-1].type == EventType.SUCCEEDED
    assert [line for e in seen for line in e.lines] == [f"tick {i}\n" for i in range(40)]
    client.close()
