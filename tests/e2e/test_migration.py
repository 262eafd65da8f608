"""Migration, drain, and recovery from dead workers and agents: nothing lost, output exact."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from processes import pid_alive
from exactness import random_stops, run_interrupted, run_plain, source, stdout_lines, wait_for_lines
from singularity_sdk import EventType, JobState, LocalCluster


def _node_of(job) -> str:
    return job.refresh().placement[0].node


def migrate_to_other_node(job, _i):
    here = _node_of(job)
    there = "node-2" if here == "node-1" else "node-1"
    job.migrate(there, timeout=60)
    if not job.state.is_terminal:
        assert _node_of(job) == there


def test_migrate_back_and_forth_at_random_moments_is_exact(client):
    expected_lines, expected_result = run_plain(client, source("dataloader_train.py"), {"LOADER_WORKERS": "0"})
    stops = random_stops(21, len(expected_lines), 2)
    job, lines, result = run_interrupted(client, source("dataloader_train.py"), stops, migrate_to_other_node,
                                         {"LOADER_WORKERS": "0"})
    assert lines == expected_lines and result == expected_result
    migrated = [e for e in job.events(follow=False) if e.type == EventType.MIGRATED]
    assert len(migrated) >= 1
    assert all(e.data["from"] != e.data["to"] and e.data["seconds"] > 0 for e in migrated)


def test_migrate_errors_are_clear(client):
    from singularity_sdk.errors import Conflict, JobNotFound

    job = client.submit("import time\nfor i in range(100):\n    time.sleep(0.05)\n")
    wait_for_lines(job, 0)
    with pytest.raises(JobNotFound, match="nodes are: node-1, node-2"):
        job.migrate("node-9")
    with pytest.raises(Conflict, match="already runs on"):
        job.migrate(_node_of(job))
    job.cancel()


def test_drain_moves_three_jobs_and_starts_nothing_there(tmp_path):
    code = "import time\nfor i in range(60):\n    print(i, flush=True)\n    time.sleep(0.05)\n'ok'"
    with LocalCluster(nodes=2, devices_per_node=3, home=tmp_path / "h") as cluster, cluster.client() as client:
        jobs = [client.submit(code, name=f"d{i}") for i in range(3)]
        for job in jobs:
            wait_for_lines(job, 2)
        assert {_node_of(j) for j in jobs} == {"node-1"}
        drained_at = time.time()
        assert client.drain("node-1").state.value == "draining"
        later = client.submit(code, name="after-drain")
        assert [j.result(timeout=120) for j in jobs + [later]] == ["ok"] * 4
        for job in jobs + [later]:
            assert stdout_lines(job) == [f"{i}\n" for i in range(60)]
            for ev in job.events(follow=False):
                if ev.type == EventType.SCHEDULED and ev.time > drained_at:
                    assert all(p["node"] == "node-2" for p in ev.data["placement"])
        assert client.undrain("node-1").state.value == "ready"
        assert client.submit("1", gpus=3).result(timeout=60) == 1


def test_killed_worker_and_killed_agent_jobs_finish_exactly_once(tmp_path):
    code = source("while_rng.py")
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", node_timeout=2.0,
                      checkpoint_every=0.3) as cluster, cluster.client() as client:
        expected_lines, expected_result = run_plain(client, code)
        # 1. kill -9 a worker: retried from its newest checkpoint.
        job = client.submit(code, name="worker-killed")
        wait_for_event(job, EventType.CHECKPOINTED)
        pid = next(int(p) for e in job.events(follow=False) if e.type == EventType.STARTED
                   for p in e.data["pids"].values())
        os.kill(pid, signal.SIGKILL)
        assert job.wait(120) == JobState.SUCCEEDED
        assert job.result() == expected_result
        events = list(job.events(follow=False))
        assert any(e.type == EventType.RETRYING for e in events)
        after = [line for e in events if e.seq > _last(events, EventType.RESUMED) for line in e.lines]
        assert after and after == expected_lines[-len(after):]
        periodic = [e.data for e in events if e.type == EventType.CHECKPOINTED]
        assert periodic and all(d.get("background") for d in periodic), "written behind the loop"

        # 2. kill -9 the agent of the node the job runs on: node lost, job resumes on the other node.
        job = client.submit(code, name="agent-killed")
        wait_for_event(job, EventType.CHECKPOINTED)
        node = _node_of(job)
        worker_pid = next(int(p) for e in job.events(follow=False) if e.type == EventType.STARTED
                          for p in e.data["pids"].values())
        os.kill(cluster.agent_pids()[node], signal.SIGKILL)
        for ev in job.events(since=job.info.last_seq):
            if ev.type == EventType.RETRYING:
                # At most one copy runs: the old worker died with its agent before the retry.
                assert not pid_alive(worker_pid)
                break
        assert job.wait(120) == JobState.SUCCEEDED
        events = list(job.events(follow=False))
        assert any(e.type == EventType.NODE_LOST and e.data["node"] == node for e in events)
        assert _node_of(job) != node
        assert job.result() == expected_result
        after = [line for e in events if e.seq > _last(events, EventType.RESUMED) for line in e.lines]
        assert after and after == expected_lines[-len(after):]


def wait_for_event(job, etype) -> None:
    for ev in job.events():
        if ev.type == etype:
            return
    raise AssertionError(f"job {job.id} ended without {etype.value}")


def _last(events, etype) -> int:
    return max(e.seq for e in events if e.type == etype)


@contextlib.contextmanager
def _migrated_through_a_store(tmp_path, program: str, after_lines: list[int]):
    """Run ``program`` plainly, then as a job moved to the other node once it has printed each
    count of ``after_lines``, on two nodes that share only a store; the cluster and the job,
    which ended as the plain run did."""
    store = f"file://{tmp_path / 'store'}"
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", store=store) as cluster, \
            cluster.client() as client:
        expected_lines, expected_result = run_plain(client, source(program))
        job = client.submit(source(program), name="via-store")
        for i, count in enumerate(after_lines):
            wait_for_lines(job, count)
            migrate_to_other_node(job, i)
        assert job.wait(120) == JobState.SUCCEEDED
        assert stdout_lines(job) == expected_lines and job.result() == expected_result
        yield cluster, job


def test_nodes_without_a_shared_filesystem_migrate_through_the_store(tmp_path):
    with _migrated_through_a_store(tmp_path, "defined_things.py", [10]) as (cluster, job):
        ck = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
        assert ck and ck[-1].data["store_path"].startswith(str(tmp_path / "store"))
        caches = {n: cluster.home / "agents" / n / "checkpoint-cache" for n in ("node-1", "node-2")}
        assert all(c.exists() for c in caches.values())  # each node kept its own copy


def test_a_fine_tuning_job_migrates_through_the_store_writing_its_frozen_backbone_once(tmp_path):
    """Back and forth through the store: the second migration's checkpoint links the frozen
    backbone from the checkpoint the node fetched, its upload copies the backbone within the store
    instead of sending it, the node it returns to links the backbone from the checkpoint it wrote
    there, and the job ends as if it had never moved."""
    with _migrated_through_a_store(tmp_path, "fine_tune.py", [8, 20]) as (_cluster, job):
        ck = [e.data for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
        assert len(ck) >= 2 and ck[0]["bytes"] > 2 * 2**20 and ck[-1]["bytes"] < 2**20, ck
        assert ck[0]["reused_bytes"] == 0 and ck[0]["upload_bytes"] >= 2 * 2**20, ck[0]
        assert ck[-1]["reused_bytes"] >= 2 * 2**20 and ck[-1]["upload_bytes"] < 2**20, ck[-1]
        # node-1 wrote the first checkpoint and restored the last: it held the backbone already
        starts = [e.data for e in job.events(follow=False) if e.type == EventType.STARTED]
        assert [s["node"] for s in starts] == ["node-1", "node-2", "node-1"], starts
        assert starts[1]["linked_bytes"] == 0 and starts[2]["linked_bytes"] >= 2 * 2**20, starts
