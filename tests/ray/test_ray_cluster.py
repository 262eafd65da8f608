"""Node agents on a real Ray cluster: several Ray nodes on this machine, all on loopback.

One module-wide Ray cluster (a head without GPUs and two nodes declaring 2 GPUs each, which
become CPU slots here) and one server joined to it as a driver; the tests run in order and the
later ones change the cluster (a node removed, a node added)."""
from __future__ import annotations

import os

# Ray then uses 127.0.0.1 for every node it starts; read once, when ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# A loaded CI machine can take longer than Ray's default 30 s to start a node's agents.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")

import time
from pathlib import Path
from typing import Iterator

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'singularity-notebooks[ray]'")
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import pid_alive  # noqa: E402
from exactness import source, stdout_lines, wait_for_lines  # noqa: E402
from singularity_sdk import EventType, JobState, LocalCluster  # noqa: E402
from backend.ray_cluster.nodes import node_name  # noqa: E402

pytestmark = pytest.mark.ray

NODE_ARGS = dict(num_cpus=1, num_gpus=2, object_store_memory=80 * 1024 * 1024, node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[Cluster]:
    # Agents keep their homes under the Ray nodes' SINGULARITY_HOME (inherited when they start).
    saved = os.environ.get("SINGULARITY_HOME")
    os.environ["SINGULARITY_HOME"] = str(tmp_path_factory.mktemp("ray-nodes"))
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, num_gpus=0, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
        node_ip_address="127.0.0.1"))
    try:
        for _ in range(2):
            cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        if saved is None:
            os.environ.pop("SINGULARITY_HOME", None)
        else:
            os.environ["SINGULARITY_HOME"] = saved


@pytest.fixture(scope="module")
def served(ray_cluster: Cluster, tmp_path_factory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("serve")
    with LocalCluster(nodes=2, home=tmp / "home", ray=ray_cluster.address, store=f"file://{tmp / 'store'}",
                      checkpoint_every=0.5, node_timeout=30, start_timeout=120) as served:
        yield served


def _ray_ids(cluster: Cluster) -> dict[str, str]:
    """Agent name -> Ray node id, for the nodes declaring GPUs."""
    return {node_name(n.node_id): n.node_id for n in cluster.worker_nodes}


def _ready(client) -> dict[str, object]:
    return {n.name: n for n in client.nodes() if n.state.value == "ready"}


def _wait(cond, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)
    return value


def _agent_pids(name: str) -> list[int]:
    """Processes of the agent named ``name`` on this machine."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"backend.agent" in cmd and name.encode() in cmd:
                out.append(int(d.name))
    return out


def test_one_agent_per_gpu_node_named_after_it_with_its_gpus(served, ray_cluster):
    with served.client() as c:
        nodes = _ready(c)
        assert set(nodes) == set(_ray_ids(ray_cluster)), "one per GPU node, none on the head"
        for n in nodes.values():
            assert [d.kind for d in n.devices] == ["cpu", "cpu"]  # num_gpus=2 without GPUs: 2 slots
            assert n.address == "127.0.0.1"  # the node's address as Ray reports it


def test_a_job_migrates_between_ray_nodes_exactly_through_the_store(served, tmp_path_factory):
    code = source("steady_rng.py")
    with served.client() as c:
        plain = c.submit(code, name="plain")
        assert plain.wait(120) == JobState.SUCCEEDED
        job = c.submit(code, name="migrated")
        wait_for_lines(job, 15)
        here = job.refresh().placement[0].node
        there = next(n for n in _ready(c) if n != here)
        job.migrate(there, timeout=60)
        assert job.wait(120) == JobState.SUCCEEDED
        assert job.refresh().placement[0].node == there
        assert stdout_lines(job) == stdout_lines(plain) and job.result() == plain.result()
        ck = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
        assert ck and "store" in ck[-1].data["store_path"]


def test_a_removed_ray_node_is_lost_and_its_job_resumes_elsewhere_exactly(served, ray_cluster):
    code = source("steady_rng.py")
    with served.client() as c:
        plain = c.submit(code, name="plain", env={"STEPS": "80"})
        assert plain.wait(120) == JobState.SUCCEEDED
        job = c.submit(code, name="survivor", env={"STEPS": "80"})
        for ev in job.events():
            if ev.type == EventType.CHECKPOINTED and ev.data.get("store_path"):
                break
        node = job.refresh().placement[0].node
        worker_pids = [int(p) for e in job.events(follow=False) if e.type == EventType.STARTED
                       for p in e.data["pids"].values()]
        ray_node = next(n for n in ray_cluster.worker_nodes if node_name(n.node_id) == node)
        ray_cluster.remove_node(ray_node, allow_graceful=False)
        assert job.wait(180) == JobState.SUCCEEDED
        events = list(job.events(follow=False))
        assert any(e.type == EventType.NODE_LOST and e.data["node"] == node for e in events)
        assert job.refresh().placement[0].node != node
        assert job.logs() == plain.logs() and job.result() == plain.result()
        assert not any(pid_alive(p) for p in worker_pids), "a worker of the lost attempt survived"
        assert not _agent_pids(node), "the lost node's agent survived"
        assert {n.name: n.state.value for n in c.nodes()}[node] == "lost"


def test_a_node_added_later_gets_an_agent_and_takes_work(served, ray_cluster):
    known = set(_ray_ids(ray_cluster))
    ray_cluster.add_node(**NODE_ARGS)
    new = (set(_ray_ids(ray_cluster)) - known).pop()
    with served.client() as c:
        _wait(lambda: new in _ready(c), f"an agent on the new node {new}")
        busy = c.submit(source("steady_rng.py"), gpus=2, name="fills-a-node", env={"STEPS": "100000"})
        other = c.submit(source("steady_rng.py"), gpus=2, name="fills-the-other", env={"STEPS": "100000"})
        for job in (busy, other):
            wait_for_lines(job, 1)
        assert {busy.refresh().placement[0].node, other.refresh().placement[0].node} == set(_ready(c))
        busy.cancel()
        other.cancel()


def test_stopping_serve_removes_every_actor_and_agent(served, ray_cluster):
    with served.client() as c:
        names = list(_ready(c))
    served.close()
    for name in names:
        _wait(lambda: not _agent_pids(name), f"agent {name} to stop")
    ray.init(address=ray_cluster.address, namespace="singularity-test")
    try:  # every GPU is free again: no actor of the server holds one
        total = ray.cluster_resources().get("GPU")
        _wait(lambda: ray.available_resources().get("GPU") == total, "the actors' GPUs to be released")
    finally:
        ray.shutdown()
