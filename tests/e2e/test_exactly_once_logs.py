"""After a kill -9 the job's log still reads as one uninterrupted run (issue 13, item 9): the
lines a dead attempt printed after its last checkpoint are superseded by the re-executed ones."""
from __future__ import annotations

import os
import signal
import time

import pytest

from singularity_sdk import EventType, JobState, LocalCluster

LINES = 80
PRINTER = f"""
import time
for i in range({LINES}):
    print(f"line {{i}}")
    time.sleep(0.05)
"""
EXPECTED = "".join(f"line {i}\n" for i in range(LINES))


def _events(job):
    return list(job.events(follow=False))


def _wait_for(job, cond, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        evs = _events(job)
        found = cond(evs)
        if found:
            return found
        assert time.monotonic() < deadline, [(e.type.value, e.data) for e in evs][-10:]
        time.sleep(0.05)


def _lines_after_checkpoint(evs, n: int):
    """The worker pid once ``n`` lines have been logged after a checkpoint (so that a kill now
    leaves lines the next attempt prints again)."""
    ckpts = [e.seq for e in evs if e.type == EventType.CHECKPOINTED]
    if not ckpts:
        return None
    after = [line for e in evs if e.seq > ckpts[-1] for line in e.lines]
    started = [e for e in evs if e.type == EventType.STARTED]
    return started[-1].data["pids"]["0"] if len(after) >= n and started else None


def _checkpointed_once(client):
    """The printer, checkpointed once a few lines in: the only checkpoint, so however slow the
    machine, the lines printed after it are the ones a kill leaves to print again."""
    job = client.submit(PRINTER)
    _wait_for(job, lambda evs: sum(len(e.lines) for e in evs) >= 3)
    job.checkpoint(timeout=60)
    return job


@pytest.fixture()
def cluster(tmp_path):
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "home", node_timeout=2.0) as c:
        yield c


def test_a_killed_worker_leaves_no_repeated_lines(cluster):
    with cluster.client() as c:
        job = _checkpointed_once(c)
        pid = _wait_for(job, lambda evs: _lines_after_checkpoint(evs, 3))
        os.kill(pid, signal.SIGKILL)
        assert job.wait(120) == JobState.SUCCEEDED
        evs = _events(job)
        assert [e for e in evs if e.type == EventType.RETRYING]
        superseded = [e for e in evs if e.type == EventType.SUPERSEDED]
        assert superseded and superseded[0].data["lines"] >= 3
        assert job.logs() == EXPECTED


def test_a_killed_agent_leaves_no_repeated_lines(cluster):
    with cluster.client() as c:
        job = _checkpointed_once(c)
        _wait_for(job, lambda evs: _lines_after_checkpoint(evs, 3))
        node = job.refresh().placement[0].node
        os.killpg(cluster.agent_pids()[node], signal.SIGKILL)  # its workers die with it
        assert job.wait(120) == JobState.SUCCEEDED
        assert job.refresh().placement[0].node != node
        assert [e for e in _events(job) if e.type == EventType.SUPERSEDED]
        assert job.logs() == EXPECTED


def test_a_restart_from_the_beginning_supersedes_every_earlier_line(cluster):
    with cluster.client() as c:
        job = c.submit(PRINTER)  # no checkpoints: the retry runs it all again
        pid = _wait_for(job, lambda evs: sum(len(e.lines) for e in evs) >= 10 and
                        [e for e in evs if e.type == EventType.STARTED][-1].data["pids"]["0"])
        os.kill(pid, signal.SIGKILL)
        assert job.wait(120) == JobState.SUCCEEDED
        superseded = [e for e in _events(job) if e.type == EventType.SUPERSEDED]
        assert len(superseded) == 1 and superseded[0].data["ranks"] is None
        assert job.logs() == EXPECTED
