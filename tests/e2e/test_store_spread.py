"""A data-parallel job whose ranks sit on nodes that share no checkpoint folder, only a store
(``serve --store URL``): each node's ranks write their parts into that node's own cache, and the
parts meet through the store, so the job checkpoints, is preempted, resized and moved, and ends
exactly as an uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from exactness import rank_lines, source, wait_for_lines
from backend.agent.transfer import CheckpointTransfer
from backend.proxy.checkpoint import digest
from backend.proxy.checkpoint.store import CheckpointStore
from singularity_sdk import EventType, JobState, LocalCluster
from singularity_sdk.errors import CheckpointFailed

STEPS = 60  # ~2 s: room for the preempt, resizes and a node loss to land before the end
ENV = {"STEPS": str(STEPS)}
#: a model whose weights and Adam moments (128 KB each) are blobs: the parts' blobs meet too
BLOBS = {**ENV, "HIDDEN": "1024"}


def _part(root, step: int, rank: int, world: int, blob: bytes) -> None:
    """Rank ``rank``'s part of checkpoint ``step``, with one blob as the ranks of a replica share."""
    def writer(f):
        f.blob_dir.mkdir(exist_ok=True)
        h = digest.new()
        h.update(blob)
        name = h.hexdigest()
        (f.blob_dir / name).write_bytes(blob)
        f.blobs[name] = len(blob)
        f.write(f"rank {rank} of step {step}".encode())
    CheckpointStore(root).write(step, rank, world, writer)


def test_parts_written_on_three_nodes_commit_on_rank_0s_node_only(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    caches = {n: tmp_path / n for n in ("a", "b", "c")}
    ranks = {"a": [0, 2], "b": [1], "c": [3]}
    ex = {n: CheckpointTransfer(store, caches[n]).exchange("j", 1, 4, ranks[n]) for n in caches}
    for n, rs in ranks.items():
        for r in rs:  # rank 3's blob is nowhere on rank 0's node: it must come from the store
            _part(caches[n] / "j", 7, r, 4, b"y" * 50 if r == 3 else b"x" * 100)
    ex["a"].step()  # nothing of the others is up yet: nothing commits
    assert not (caches["a"] / "j" / "ckpt-00000007").exists()
    ex["b"].step()
    ex["c"].step()
    assert not (caches["b"] / "j" / ".ckpt-00000007.tmp").exists(), "the sender keeps no staging folder"
    ex["a"].step()
    ref = CheckpointStore(caches["a"] / "j").latest()
    assert ref is not None and ref.step == 7 and ref.world_size == 4
    assert {ref.rank_file(r).read_text() for r in range(4)} == {f"rank {r} of step 7" for r in range(4)}
    assert sorted(p.read_bytes() for p in ref.blob_dir.iterdir()) == [b"x" * 100, b"y" * 50]
    assert CheckpointStore(caches["a"] / "j").verify(ref.path, contents=True) == ref
    assert not (tmp_path / "store" / "j" / "parts" / "a1" / "ckpt-00000007").exists(), "parts are dropped once in"


def test_parts_of_a_crashed_attempt_never_join_a_checkpoint(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    a, b = tmp_path / "a", tmp_path / "b"
    _part(b / "j", 5, 1, 2, b"old")  # left by attempt 1 on node b, before attempt 2 started
    old = b / "j" / ".ckpt-00000005.tmp" / "rank-1.json"
    os.utime(old, (1, 1))
    ta, tb = CheckpointTransfer(store, a), CheckpointTransfer(store, b)
    ta.fence("j", 2)
    ex_a, ex_b = ta.exchange("j", 2, 2, [0]), tb.exchange("j", 2, 2, [1])
    _part(a / "j", 5, 0, 2, b"new")
    ex_b.step()
    ex_a.step()
    assert CheckpointStore(a / "j").latest() is None
    (b / "j" / ".ckpt-00000005.tmp").rename(b / "j" / "gone")
    _part(b / "j", 5, 1, 2, b"new")
    ex_b.step()
    ex_a.step()
    ref = CheckpointStore(a / "j").latest()
    assert ref is not None and [p.read_bytes() for p in ref.blob_dir.iterdir()] == [b"new"]


def test_a_data_parallel_job_spread_over_nodes_checkpoints_through_the_store(tmp_path):
    store = tmp_path / "store"
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", store=f"file://{store}",
                      checkpoint_timeout=120) as cluster, cluster.client() as client:
        plain = client.submit(source("ddp_train.py"), gpus=2, env=BLOBS, name="ddp-plain")
        assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
        assert {p.node for p in plain.info.placement} == {"node-1", "node-2"}
        reference = rank_lines(plain), plain.result()

        job = client.submit(source("ddp_train.py"), gpus=2, env=BLOBS, name="ddp-spread")
        wait_for_lines(job, 12)
        assert {p.node for p in job.refresh().placement} == {"node-1", "node-2"}
        job.preempt(timeout=120)  # a checkpoint of two parts written on two nodes
        assert job.state == JobState.PREEMPTED
        ck = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
        assert ck and str(store) in ck[-1].data["store_path"]
        job.resume()
        wait_for_lines(job, 30)
        job.resize(1, timeout=120)  # both ranks on one device of one node
        assert len(job.info.placement) == 1
        wait_for_lines(job, 42)
        job.resize(2, timeout=120)  # and spread over both nodes again
        assert {p.node for p in job.info.placement} == {"node-1", "node-2"}
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert (rank_lines(job), job.result()) == reference
        caches = [cluster.home / "agents" / n / "checkpoint-cache" for n in ("node-1", "node-2")]
        assert not any((c / job.id).exists() and any((c / job.id).glob(".ckpt-*.tmp")) for c in caches), \
            "parts of a checkpoint were left behind in a node's cache"


def _start_agent_with_its_own_folder(cluster: LocalCluster, name: str) -> subprocess.Popen:
    """An agent whose checkpoint folder no other node sees, and no store: the layout that cannot work."""
    env = {**os.environ, "SINGULARITY_HOME": str(cluster.home), "SINGULARITY_JOIN_TOKEN": cluster.agent_token}
    log = open(cluster.home / "logs" / f"agent-{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "backend.agent", "--server", cluster.url, "--name", name,
                             "--devices", "1", "--home", str(cluster.home / "agents" / name),
                             "--checkpoint-root", str(cluster.home / "agents" / name / "own-checkpoints"),
                             "--orphan-timeout", "60"],
                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    with cluster.client() as c:
        while not any(n.name == name and n.state.value == "ready" for n in c.nodes()):
            assert proc.poll() is None, f"the agent {name} exited"
            time.sleep(0.1)
    return proc


def test_ranks_on_nodes_that_share_no_folder_and_no_store_fail_their_checkpoint_at_once(tmp_path):
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "h") as cluster:
        other = _start_agent_with_its_own_folder(cluster, "apart")
        try:
            with cluster.client() as client:
                job = client.submit(source("ddp_train.py"), gpus=2, env=ENV, name="ddp-apart")
                wait_for_lines(job, 8)
                assert {p.node for p in job.refresh().placement} == {"node-1", "apart"}
                with pytest.raises(CheckpointFailed, match="--store"):  # says what to do; no hang
                    job.preempt(timeout=120)
                assert job.wait(180) == JobState.SUCCEEDED, job.info.error  # and the job runs on
                lines = rank_lines(job)
                assert sorted(lines) == [0, 1] and len({v[-1].split()[-1] for v in lines.values()}) == 1
        finally:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait()


def test_a_spread_job_whose_rank_0_node_dies_resumes_from_the_store_exactly(tmp_path):
    """Rank 0's node is where the parts met: the committed checkpoints it uploaded carry the job on."""
    with LocalCluster(nodes=3, devices_per_node=1, home=tmp_path / "h", store=f"file://{tmp_path / 'store'}",
                      node_timeout=600) as cluster, cluster.client() as client:
        plain = client.submit(source("ddp_train.py"), gpus=2, env=BLOBS, name="ddp-plain")
        assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
        reference = rank_lines(plain)
        job = client.submit(source("ddp_train.py"), gpus=2, env=BLOBS, name="ddp-node-lost", checkpoint_every=0.3)
        for ev in job.events():
            if ev.type == EventType.CHECKPOINTED and ev.data.get("step", 0) > 5 and ev.data.get("store_path"):
                break
        started = [e.data for e in job.events(follow=False) if e.type == EventType.STARTED]
        node = next(d["node"] for d in started if "0" in d["pids"])
        os.killpg(cluster.agent_pids()[node], signal.SIGKILL)
        for pid in (int(p) for d in started if d["node"] == node for p in d["pids"].values()):
            try:
                os.kill(pid, signal.SIGKILL)  # the node is gone: its workers with it
            except ProcessLookupError:
                pass
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        events = list(job.events(follow=False))
        assert any(e.type == EventType.NODE_LOST and e.data["node"] == node for e in events)
        assert node not in {p.node for p in job.info.placement}
        assert job.result() == plain.result()
        resumed = max(e.seq for e in events if e.type == EventType.RESUMED)
        for rank, expected in reference.items():  # from the restore on, the uninterrupted run's output
            after = [line for e in events if e.seq > resumed and e.data.get("stream") == "stdout"
                     and e.data.get("rank") == rank for line in e.lines]
            assert after and after == expected[-len(after):]
