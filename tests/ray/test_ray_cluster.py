"""Node agents on a real Ray cluster: several Ray nodes on this machine, all on loopback.

One module-wide Ray cluster (a head without GPUs and two nodes declaring 2 GPUs each, which
become CPU slots here) and one server joined to it as a driver; the tests run in order and the
later ones change the cluster (a node removed, a node added)."""
from __future__ import annotations

import os

# Ray then uses 127.0.0.1 for every node it starts; read once, when ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import time
from pathlib import Path
from typing import Iterator

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'singularity-notebooks[ray]'")
from ray.cluster_utils import Cluster  # noqa: E402

from processes import pid_alive  # noqa: E402
from exactness import rank_lines, source, stdout_lines, wait_for_lines  # noqa: E402
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
                      node_timeout=30, start_timeout=120) as served:
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


def test_one_agent_per_gpu_node_named_after_it_with_its_gpus(served, ray_cluster, capsys):
    from singularity_sdk.cli import main as singularityctl

    with served.client() as c:
        nodes = _ready(c)
        ids = _ray_ids(ray_cluster)
        assert set(nodes) == set(ids), "one per GPU node, none on the head"
        for n in nodes.values():
            assert [d.kind for d in n.devices] == ["cpu", "cpu"]  # num_gpus=2 without GPUs: 2 slots
            assert n.address == "127.0.0.1"  # the node's address as Ray reports it
            assert n.ray_node_id == ids[n.name]
    capsys.readouterr()
    assert singularityctl(["nodes", "--url", served.url, "--token", served.token]) == 0
    shown = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    for name, node_id in ids.items():  # the full Ray node id and the node's address
        assert node_id in shown[name] and "127.0.0.1" in shown[name]


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


def test_a_data_parallel_job_spans_two_ray_nodes_and_is_resized(served, ray_cluster):
    # Each node's ranks write their parts into that node's cache; the parts meet in the store.
    env = {"STEPS": "12"}
    with served.client() as c:
        plain = c.submit(source("ddp_train.py"), gpus=4, env=env, name="ddp-two-nodes")
        assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
        assert {p.node for p in plain.info.placement} == set(_ray_ids(ray_cluster))
        lines = rank_lines(plain)
        assert sorted(lines) == [0, 1, 2, 3]
        assert len({v[-1].split()[-1] for v in lines.values()}) == 1  # the replicas agree
        job = c.submit(source("ddp_train.py"), gpus=4, env=env, name="ddp-resized")
        wait_for_lines(job, 12)
        job.resize(2, timeout=120)  # two ranks per GPU, on one node
        assert len(job.info.placement) == 1
        wait_for_lines(job, 28)
        job.resize(4, timeout=120)  # over both nodes again
        assert {p.node for p in job.info.placement} == set(_ray_ids(ray_cluster))
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert (rank_lines(job), job.result()) == (lines, plain.result())
        resized = [e.data for e in job.events(follow=False) if e.type == EventType.RESIZED]
        assert [(d["from"], d["to"]) for d in resized] == [(4, 2), (2, 4)]


def test_a_node_added_later_gets_an_agent_and_takes_work(served, ray_cluster):
    known = set(_ray_ids(ray_cluster))
    ray_cluster.add_node(**NODE_ARGS)
    new = (set(_ray_ids(ray_cluster)) - known).pop()
    with served.client() as c:
        _wait(lambda: new in _ready(c), f"an agent on the new node {new}")
        jobs = [c.submit(source("steady_rng.py"), gpus=2, name=f"fills-{i}", env={"STEPS": "100000"})
                for i in range(3)]
        for job in jobs:  # three whole-node jobs on three nodes: one of them runs on the new one
            wait_for_lines(job, 1)
        assert {job.refresh().placement[0].node for job in jobs} == set(_ray_ids(ray_cluster))
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.wait(60)


def _running_with_a_stored_checkpoint(c, name: str, steps: int = 80):
    plain = c.submit(source("steady_rng.py"), name=f"{name}-plain", env={"STEPS": str(steps)})
    assert plain.wait(120) == JobState.SUCCEEDED
    job = c.submit(source("steady_rng.py"), name=name, env={"STEPS": str(steps)}, checkpoint_every=0.5)
    for ev in job.events():
        if ev.type == EventType.CHECKPOINTED and ev.data.get("store_path"):
            break
    return plain, job


def test_a_ray_node_drained_gracefully_moves_its_jobs_before_it_goes(served, ray_cluster):
    from ray.core.generated import autoscaler_pb2

    with served.client() as c:
        plain, job = _running_with_a_stored_checkpoint(c, "drained")
        node = job.refresh().placement[0].node
        ray_node = next(n for n in ray_cluster.worker_nodes if node_name(n.node_id) == node)
        # What KubeRay's scale-down or a preemption notice does: tell Ray the node is going.
        accepted, why = ray_cluster.head_node.get_gcs_client().drain_node(
            ray_node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "test: the node is going", int(time.time() * 1000) + 120_000)
        assert accepted, why
        _wait(lambda: (i := job.refresh()).state == JobState.RUNNING and i.placement[0].node != node,
              "the job to move off the draining node")
        assert {n.name: n.state.value for n in c.nodes()}[node] == "draining"
        ray_cluster.remove_node(ray_node)
        assert job.wait(180) == JobState.SUCCEEDED
        events = list(job.events(follow=False))
        assert any(e.type == EventType.MIGRATED for e in events)
        assert not any(e.type == EventType.NODE_LOST for e in events), "moved before the node went"
        assert stdout_lines(job) == stdout_lines(plain) and job.result() == plain.result()


def test_a_removed_ray_node_is_lost_and_its_job_resumes_elsewhere_exactly(served, ray_cluster):
    with served.client() as c:
        plain, job = _running_with_a_stored_checkpoint(c, "survivor")
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


def test_stopping_serve_removes_every_actor_and_agent(served, ray_cluster):
    with served.client() as c:
        names = list(_ready(c))
    served.close()
    for name in names:
        _wait(lambda: not _agent_pids(name), f"agent {name} to stop")
    _wait(lambda: _free_gpus(ray_cluster) == 2 * len(ray_cluster.worker_nodes), "every GPU to be free again")


def test_the_jupyter_extension_runs_its_agents_on_ray(ray_cluster, tmp_path, monkeypatch):
    from jupyter_ext.embedded import BackendManager

    # a server configured in the environment (by a test that ran before) would be used instead
    for name in ("SINGULARITY_URL", "SINGULARITY_TOKEN", "SINGULARITY_HOME"):
        monkeypatch.delenv(name, raising=False)

    manager = BackendManager(home=str(tmp_path / "jupyter-home"), ray=ray_cluster.address, start_timeout=120)
    try:
        info = manager.start()
        assert info.error is None, info.error
        from singularity_sdk import Client

        with Client(info.url, info.token) as c:
            _wait(lambda: set(_ready(c)) == set(_ray_ids(ray_cluster)), "agents on the Ray nodes")
    finally:
        manager.stop()
    _wait(lambda: _free_gpus(ray_cluster) == 2 * len(ray_cluster.worker_nodes), "every GPU to be free again")


def _free_gpus(cluster: Cluster) -> int:
    """GPUs no actor holds, as the cluster's GCS counts them (asked without joining as a driver)."""
    import subprocess
    import sys

    code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print('free GPUs', int(ray.available_resources().get('GPU', 0)), flush=True)")
    out = subprocess.run([sys.executable, "-c", code, cluster.address], capture_output=True, text=True, timeout=120)
    # Ray may print its own warnings (a raylet's lagging heartbeats on a busy machine) around ours
    counts = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("free GPUs ")]
    return int(counts[-1]) if out.returncode == 0 and counts else -1
