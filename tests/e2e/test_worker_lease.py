"""Workers run on a lease (issue 13): a worker whose agent has not heard from the server for
longer than the lease checkpoints at its next safe point and stops by itself, and the job resumes
from that checkpoint once the server is back, its output identical to an uninterrupted run's."""
from __future__ import annotations

import os
import signal
import time

import pytest

from exactness import source
from processes import pid_alive
from singularity_sdk import EventType, JobState, LocalCluster

PROGRAM = source("steady_rng.py")
ENV = {"STEPS": "120"}  # ~6 s: still running when a 3 s lease runs out


def _events(job):
    return list(job.events(follow=False))


@pytest.fixture(scope="module")
def plain():
    with LocalCluster(nodes=1, devices_per_node=1) as cluster, cluster.client() as c:
        job = c.submit(PROGRAM, name="plain", env=ENV)
        assert job.wait(120) == JobState.SUCCEEDED
        return job.logs(), job.result()


@pytest.mark.parametrize("partition", ["killed", "stopped"])
def test_a_worker_whose_agent_lost_the_server_checkpoints_stops_and_resumes_exactly(tmp_path, plain, partition):
    """``killed``: the server is killed and started again later; ``stopped``: it is frozen
    (SIGSTOP), its connections open but silent, as behind a partition, then thawed."""
    logs, value = plain
    # local agents get the server's node timeout as their lease
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "home", node_timeout=3) as cluster:
        with cluster.client() as c:
            job = c.submit(PROGRAM, name="partitioned", env=ENV)
            deadline = time.monotonic() + 90
            while sum(len(e.lines) for e in _events(job)) < 8:
                assert time.monotonic() < deadline, job.refresh().state
                time.sleep(0.1)
            pid = int([e for e in _events(job) if e.type == EventType.STARTED][-1].data["pids"]["0"])
        server = cluster.proc.pid
        if partition == "killed":
            cluster.kill_server()  # the agent and its worker stay, and hear nothing from now on
        else:
            os.kill(server, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while pid_alive(pid):  # the lease runs out: the worker checkpoints and stops by itself
                assert time.monotonic() < deadline, "the worker outlived its lease"
                time.sleep(0.1)
        finally:
            if partition == "stopped":
                os.kill(server, signal.SIGCONT)
        if partition == "killed":
            cluster.restart_server()
        with cluster.client() as c:
            job = c.get(job.id)
            assert job.wait(120) == JobState.SUCCEEDED, job.info.error
            evs = _events(job)
            stopped = next(e.data for e in evs if e.type == EventType.PREEMPTED)
            assert stopped["requeue"] and "lease" in stopped["reason"] and stopped["step"] > 0
            # a planned stop, not a crash: nothing to retry, no line to supersede
            assert not [e for e in evs if e.type in (EventType.RETRYING, EventType.NODE_LOST, EventType.SUPERSEDED)]
            # the next attempt resumed from the checkpoint the lease's stop took
            last = [e.data for e in evs if e.type == EventType.CHECKPOINTED][-1]
            resumed = next(e.data for e in evs if e.type == EventType.RESUMED)
            assert resumed["step"] == stopped["step"] == last["step"]
            assert job.refresh().info.attempt == 2
            assert job.logs() == logs and job.result() == value


def test_a_frozen_agents_node_is_lost_though_its_connection_stays_open(tmp_path, plain):
    """An agent that is connected but silent (frozen here; a partition without FIN or RST looks
    the same to the server) loses its node after the node timeout, and its job goes on elsewhere
    with a plain run's output; the old worker ends itself while the agent is still frozen (it
    has not heard from its agent for the worker lease)."""
    logs, value = plain
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "home", node_timeout=3) as cluster, \
            cluster.client() as c:
        job = c.submit(PROGRAM, name="frozen-agent", env=ENV)
        deadline = time.monotonic() + 90
        while sum(len(e.lines) for e in _events(job)) < 8:
            assert time.monotonic() < deadline, job.refresh().state
            time.sleep(0.1)
        node = job.refresh().placement[0].node
        pid = int([e for e in _events(job) if e.type == EventType.STARTED][-1].data["pids"]["0"])
        agent = cluster.agent_pids()[node]
        os.kill(agent, signal.SIGSTOP)
        try:
            assert job.wait(120) == JobState.SUCCEEDED, job.info.error
            # the old worker ends itself while its agent is still frozen (its lease on the agent)
            deadline = time.monotonic() + 60
            while pid_alive(pid):
                assert time.monotonic() < deadline, "the frozen agent's worker ran on"
                time.sleep(0.1)
        finally:
            os.kill(agent, signal.SIGCONT)
        lost = [e.data for e in _events(job) if e.type == EventType.NODE_LOST]
        assert lost and lost[0]["node"] == node and "connected but silent" in lost[0]["why"]
        assert job.refresh().placement[0].node != node
        assert job.logs() == logs and job.result() == value


def test_a_restore_takes_the_checkpoint_the_server_knows_not_a_newer_unreported_one(tmp_path, plain):
    """A checkpoint the server never heard of (a partitioned worker's lease wrote it; its report
    never arrived) holds output missing from the job's log: the server names the checkpoint to
    restore, and the node removes newer ones instead of picking them up, now or later."""
    import json
    import shutil

    logs, value = plain
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "home") as cluster, cluster.client() as c:
        job = c.submit(PROGRAM, name="named", env=ENV)
        deadline = time.monotonic() + 90
        while sum(len(e.lines) for e in _events(job)) < 8:
            assert time.monotonic() < deadline, job.refresh().state
            time.sleep(0.1)
        job.preempt(timeout=120)
        step = [e for e in _events(job) if e.type == EventType.CHECKPOINTED][-1].data["step"]
        known = next(p for p in (cluster.home / "checkpoints").rglob(f"ckpt-{step:08d}") if p.parent.name == job.id)
        stale = known.parent / f"ckpt-{step + 1000:08d}"  # what an unreported newer checkpoint looks like
        shutil.copytree(known, stale)
        manifest = json.loads((stale / "manifest.json").read_text())
        (stale / "manifest.json").write_text(json.dumps({**manifest, "step": step + 1000}))
        job.resume()
        assert job.wait(120) == JobState.SUCCEEDED, job.info.error
        resumed = [e for e in _events(job) if e.type == EventType.RESUMED][-1].data
        assert resumed["checkpoint"].endswith(known.name), resumed
        assert not stale.exists()
        assert job.logs() == logs and job.result() == value
