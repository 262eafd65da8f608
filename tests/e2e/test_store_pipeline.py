"""Through a store (``serve --store URL``), a migration's checkpoint is uploaded while the worker
writes it (backend/agent/transfer.py, `Streamer`) and copied by the destination as it arrives
(backend/agent/prefetch.py), the job ends exactly as an uninterrupted run, and a worker killed
half-way through a streamed write resumes from the checkpoint before."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from exactness import assert_retried_from_a_checkpoint, run_plain, source, stdout_lines, wait_for_lines
from backend.agent.transfer import STREAM_ENV, STREAMS
from backend.proxy.checkpoint.store import HOLD_HOOK_ENV
import pytest

from singularity_sdk import CheckpointFailed, EventType, JobState, LocalCluster
from singularity_sdk.render import describe

ENV = {"STEPS": "200"}
#: a few MB of state, so the rank file is more than a header
CODE = "import os\nballast = os.urandom(4 << 20)\n" + source("steady_rng.py")


def _streamed(store: Path, job_id: str) -> list[Path]:
    return [p for p in (store / job_id / STREAMS).rglob("rank-*.pt") if p.stat().st_size > 0] \
        if (store / job_id / STREAMS).exists() else []


def _until_streamed(store: Path, job, timeout: float = 60.0) -> list[Path]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            found = _streamed(store, job.id)
        except FileNotFoundError:  # moved into place between the listing and the stat
            found = []
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("no rank file reached the store while it was written")


def _until_prefetched(home: Path, timeout: float = 60.0) -> list[Path]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = [p for p in home.rglob(".ckpt-*.prefetch/rank-*.pt") if p.exists() and p.stat().st_size > 0]
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("the destination copied nothing while the checkpoint was written")


def _node_of(job) -> str:
    return job.refresh().placement[0].node


def test_a_migration_through_the_store_uploads_while_the_worker_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(STREAM_ENV, "1")  # the cluster's agents inherit it
    store = tmp_path / "store"
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", store=store.as_uri()) as cluster, \
            cluster.client() as client:
        expected_lines, expected_result = run_plain(client, CODE, ENV)

        # while the gate exists, the worker waits after its first write into a rank file: the test
        # looks at the store and the destination meanwhile, however slow the machine is
        gate = tmp_path / "hold-the-write"
        job = client.submit(CODE, env={**ENV, HOLD_HOOK_ENV: str(gate)}, name="streamed-migration")
        wait_for_lines(job, 5)
        gate.touch()
        there = "node-2" if _node_of(job) == "node-1" else "node-1"
        since = job.refresh().info.last_seq
        job.migrate(there, wait=False)
        _until_streamed(store, job)
        prefetched = _until_prefetched(tmp_path / "h")
        assert all(there in p.parts for p in prefetched), "only the destination prefetches"
        # the worker is still inside its write: nothing of this checkpoint has been reported yet
        assert not [e for e in job.events(since=since, follow=False) if e.type == EventType.CHECKPOINTED]
        gate.unlink()
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert stdout_lines(job) == expected_lines and job.result() == expected_result
        moved = [e for e in job.events(follow=False) if e.type == EventType.MIGRATED]
        assert moved and moved[0].data["to"] == there
        started = [e for e in job.events(since=since, follow=False) if e.type == EventType.STARTED]
        assert started[0].data["prefetched_bytes"] > 0 and started[0].data["fetch_s"] >= 0
        assert "of it while it was written" in describe(started[0])  # what `singularityctl events` shows

        # kill -9 the worker half-way through a streamed write: its part in the store is never
        # restored; the retry resumes from the checkpoint before, and the output stays exact
        job = client.submit(CODE, env={**ENV, HOLD_HOOK_ENV: str(gate)}, name="killed-mid-stream")
        wait_for_lines(job, 5)
        job.checkpoint(timeout=60)
        pid = next(int(p) for e in job.events(follow=False) if e.type == EventType.STARTED
                   for p in e.data["pids"].values())
        gate.touch()
        job.act("checkpoint")
        _until_streamed(store, job)
        os.kill(pid, signal.SIGKILL)
        gate.unlink()  # the retry's writes go through
        assert_retried_from_a_checkpoint(job, expected_lines, expected_result)


def test_a_migration_called_off_stops_the_destinations_prefetch(tmp_path):
    """The job is inside a long call when the migration is asked for: no safe point comes within
    the bound, the job runs on where it is, and the node that was copying its checkpoint is told
    to stop (it would otherwise follow the job's checkpoints for minutes)."""
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", store=(tmp_path / "store").as_uri()) \
            as cluster, cluster.client() as client:
        # "loading" is printed inside the function that then sleeps: no safe point after it (a
        # top-level print and sleep would have one between them, reached on a slow machine)
        job = client.submit(source("stuck_then_loop.py"), filename="stuck_then_loop.py",
                            env={"STUCK_S": "30", "STEPS": "5"}, name="stuck-in-a-call")
        wait_for_lines(job, 1)
        there = "node-2" if _node_of(job) == "node-1" else "node-1"
        with pytest.raises(CheckpointFailed):
            job.migrate(there, checkpoint_timeout=1.0, timeout=60)
        assert job.refresh().state == JobState.RUNNING
        log = tmp_path / "h" / "logs" / f"agent-{there}.log"
        end = time.monotonic() + 30
        while "will not start here after all" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.1)
        assert "will not start here after all" in log.read_text(), log.read_text()[-2000:]
        job.cancel()
