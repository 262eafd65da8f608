"""Data-parallel jobs under the proxy: the same DDP script, unmodified, gives bitwise-identical
losses and parameters whatever devices it ran on and however often it was resized, preempted,
migrated or restarted after a rank died."""
from __future__ import annotations

import os
import random
import signal

import pytest

from exactness import rank_lines, source, wait_for_lines
from backend.proxy.checkpoint.store import HOLD_HOOK_ENV
from singularity_sdk import EventType, JobState
from singularity_sdk.errors import Conflict, InvalidRequest

STEPS = 50
ENV = {"STEPS": str(STEPS)}
LINES = 4 * (STEPS + 1)  # every rank prints a loss per step and its final parameter digest


@pytest.fixture(scope="module")
def reference(cluster):
    """The never-interrupted run: W = 4 ranks, one device each (spread over both nodes)."""
    with cluster.client() as client:
        job = client.submit(source("ddp_train.py"), gpus=4, env=ENV, name="ddp-reference")
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        lines = rank_lines(job)
        assert sorted(lines) == [0, 1, 2, 3] and all(len(v) == STEPS + 1 for v in lines.values())
        assert len({v[-1].split()[-1] for v in lines.values()}) == 1  # the replicas agree
        assert {p.node for p in job.info.placement} == {"node-1", "node-2"}
        return lines, job.result()


@pytest.mark.parametrize("gpus", [2, 1])
def test_fewer_devices_than_ranks_is_exact(client, reference, gpus):
    job = client.submit(source("ddp_train.py"), gpus=gpus, ranks=4, env=ENV, name=f"ddp-on-{gpus}")
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    assert sum(len(p.devices) for p in job.info.placement) == gpus
    assert (rank_lines(job), job.result()) == reference


def test_resize_4_2_1_4_at_random_moments_is_exact(client, reference):
    stops = sorted(random.Random(int(os.environ.get("RESIZE_SEED", "5"))).sample(range(8, LINES - 60), 3))
    job = client.submit(source("ddp_train.py"), gpus=4, env=ENV, name="ddp-resized")
    for target, gpus in zip(stops, (2, 1, 4)):
        wait_for_lines(job, target)
        job.resize(gpus, timeout=120)
        assert job.state == JobState.RUNNING
        assert sum(len(p.devices) for p in job.info.placement) == gpus
        assert job.info.ranks == 4
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    assert (rank_lines(job), job.result()) == reference
    resized = [e.data for e in job.events(follow=False) if e.type == EventType.RESIZED]
    assert [(d["from"], d["to"], d["splicing"]) for d in resized] == [(4, 2, 2), (2, 1, 4), (1, 4, 1)]
    assert all(set(d["phases"]) == {"barrier", "checkpoint", "restart", "restore"} for d in resized)


def test_preempted_while_spread_then_migrated_between_nodes_is_exact(client, reference):
    job = client.submit(source("ddp_train.py"), gpus=4, env=ENV, name="ddp-moved")
    wait_for_lines(job, 30)
    assert {p.node for p in job.refresh().placement} == {"node-1", "node-2"}
    job.preempt(timeout=120)
    assert job.state == JobState.PREEMPTED
    job.resume()
    wait_for_lines(job, 90)
    job.resize(2, timeout=120)  # two ranks per device, on one node
    here = job.info.placement[0].node
    assert [p.node for p in job.info.placement] == [here]
    wait_for_lines(job, 130)
    there = "node-2" if here == "node-1" else "node-1"
    job.migrate(there, timeout=120)
    assert [p.node for p in job.info.placement] == [there]
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    assert (rank_lines(job), job.result()) == reference


def test_a_killed_rank_restarts_the_job_from_its_consistent_checkpoint(client, reference):
    job = client.submit(source("ddp_train.py"), gpus=4, env=ENV, name="ddp-rank-killed", checkpoint_every=0.3)
    for ev in job.events():
        if ev.type == EventType.CHECKPOINTED and ev.data.get("step", 0) > 5:
            break
    pids = {r: p for e in job.events(follow=False) if e.type == EventType.STARTED for r, p in e.data["pids"].items()}
    os.kill(int(pids["2"]), signal.SIGKILL)  # each node reports the ranks it started
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    retry = next(e.data for e in job.events(follow=False) if e.type == EventType.RETRYING)
    assert retry["from_step"] > 5
    # the periodic checkpoints were written behind the loop, every rank's part in the background,
    # and the one the retry restored is among them
    written = [e.data for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
    assert written and all(d.get("background") and d["snapshot_s"] <= d["seconds"] for d in written)
    assert retry["from_step"] in {d["step"] for d in written}
    _exact_since_restore(job, reference)


def test_a_rank_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(client, reference, tmp_path):
    gate = tmp_path / "hold-the-write"  # while it exists, every rank's write waits half-way
    job = client.submit(source("ddp_train.py"), gpus=4, env={**ENV, HOLD_HOOK_ENV: str(gate)},
                        name="ddp-killed-mid-write")
    wait_for_lines(job, 20)
    job.checkpoint(timeout=60)  # a good one
    pids = {r: p for e in job.events(follow=False) if e.type == EventType.STARTED for r, p in e.data["pids"].items()}
    since = job.refresh().info.last_seq
    gate.touch()
    job.act("checkpoint")
    for ev in job.events(since=since):  # rank 2 is half-way through its part, however slow the machine
        if ev.data.get("rank") == 2 and any("test hook: holding a checkpoint write" in x for x in ev.lines):
            break
    os.kill(int(pids["2"]), signal.SIGKILL)
    gate.unlink()  # the others finish their parts; the set never completes
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    checkpoints = [e.data["step"] for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED]
    retry = next(e.data for e in job.events(follow=False) if e.type == EventType.RETRYING)
    assert retry["from_step"] == checkpoints[0]  # the torn one was never reported
    _exact_since_restore(job, reference)


def _exact_since_restore(job, reference) -> None:
    """Steps between the restored checkpoint and the crash run (and print) again in the retry;
    from the restore on, every rank's output is the uninterrupted run's, and so is the result.
    And the job's log reads as one uninterrupted run, rank by rank: every rank's lines printed
    after the checkpoint by the attempt that crashed are superseded by the retry's."""
    assert job.result() == reference[1]
    events = list(job.events(follow=False))
    resumed = max(e.seq for e in events if e.type == EventType.RESUMED)
    for rank, expected in reference[0].items():
        after = [line for e in events if e.seq > resumed and e.data.get("stream") == "stdout"
                 and e.data.get("rank") == rank for line in e.lines]
        assert after and after == expected[-len(after):]
    logged: dict[int, list[str]] = {}
    for line in job.logs().splitlines(keepends=True):
        rank, _, text = line[len("[rank "):].partition("] ")
        if text.startswith(("step ", "rank ")):  # the script's stdout (stderr may hold warnings)
            logged.setdefault(int(rank), []).append(text)
    assert logged == reference[0]


def test_resize_errors_say_what_is_possible(client):
    job = client.submit(source("ddp_train.py"), gpus=4, env={"STEPS": "400"}, name="ddp-errors")
    with pytest.raises(InvalidRequest, match="can run on 1, 2, 4 device"):
        job.resize(3)
    wait_for_lines(job, 4)
    with pytest.raises(Conflict, match="already runs on 4"):
        job.resize(4)
    job.cancel()
    single = client.submit("import time\nfor i in range(200):\n    time.sleep(0.05)\n", name="one-rank")
    with pytest.raises(InvalidRequest, match="--ranks"):
        single.resize(2)
    single.cancel()
    # a queued job changes size at once: hold every device so that it stays queued meanwhile
    blocker = client.submit("import time\ntime.sleep(600)\n", gpus=4, name="blocker")
    wait_for_lines(blocker, 0)
    waiting = client.submit("1", gpus=4, ranks=4, name="queued-resize")
    assert waiting.refresh().state == JobState.QUEUED
    waiting.resize(2, wait=False)
    assert waiting.refresh().info.gpus == 2
    blocker.cancel()
    assert waiting.wait(120) == JobState.SUCCEEDED
    assert waiting.info.gpus == 2


def test_rank_0s_node_hosts_the_rendezvous_for_ranks_on_other_nodes(tmp_path):
    """Agents report how other nodes reach them; a job's MASTER_ADDR is rank 0's node's address
    (127.0.0.2 here: another loopback address, so a job that still used 127.0.0.1 by habit would
    pass only by luck, and one that used the wrong address would hang), and its MASTER_PORT the
    port rank 0's node chose and announced before the other node's ranks started."""
    from singularity_sdk import LocalCluster

    code = ("import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(1) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], t.item(), flush=True)\n"
            "os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), t.item()")
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h",
                      env={"SINGULARITY_AGENT_ADDRESS": "127.0.0.2"}) as cluster, cluster.client() as client:
        assert {n.address for n in client.nodes()} == {"127.0.0.2"}
        job = client.submit(code, gpus=2, name="two-nodes")
        assert job.wait(120) == JobState.SUCCEEDED, job.info.error
        assert {p.node for p in job.info.placement} == {"node-1", "node-2"}
        events = list(job.events(follow=False))
        [chosen] = [e for e in events if e.type == EventType.RENDEZVOUS]
        host = next(p.node for p in job.info.placement if 0 in p.ranks)
        assert chosen.data["node"] == host
        assert job.result() == ("127.0.0.2", chosen.data["port"], 3.0)
        # the other node's ranks were started only once the port was known
        started = [e for e in events if e.type == EventType.STARTED]
        assert [e.data["node"] for e in started if e.seq > chosen.seq] != []
        # a job on one node needs no announcement: its node picks the port and starts every rank
        one = client.submit(code, gpus=1, ranks=2, name="one-node")
        assert one.wait(120) == JobState.SUCCEEDED, one.info.error
        assert not [e for e in one.events(follow=False) if e.type == EventType.RENDEZVOUS]
        assert one.result()[1] > 0


def test_a_rank_that_cannot_be_checkpointed_fails_the_preemption_and_all_ranks_run_on(client, reference):
    from singularity_sdk.errors import CheckpointFailed

    # Only rank 1 opens a socket, inside the loop (so it cannot be rebuilt by re-running a line).
    code = source("ddp_train.py").replace(
        "    time.sleep(",
        "    if rank == 1 and step == 2:\n        sock = __import__('socket').socket()\n    time.sleep(")
    job = client.submit(code, gpus=4, env=ENV, name="ddp-unsaveable")
    wait_for_lines(job, 20)
    with pytest.raises(CheckpointFailed, match="sock"):
        job.preempt(timeout=60)
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    events = list(job.events(follow=False))
    assert not any(e.type in (EventType.RETRYING, EventType.PREEMPTED) for e in events)
    assert sorted(e.data["code"] for e in events if e.type == EventType.WORKER_EXITED) == [0, 0, 0, 0]
    assert (rank_lines(job), job.result()) == reference


def test_epochs_with_rank_0_validation_and_a_barrier_resume_exactly(client):
    """The end of an epoch is where ranks part ways: rank 0 validates (safe points only it
    passes) while the others wait in the barrier. Interruptions at random moments, one aimed at
    an epoch's last step, must cut every rank at the same place of the collective sequence, and
    the run must end as an uninterrupted one. (The thread-level tests in
    tests/proxy/test_collectives_exact.py pin the shapes the cut must refuse.)"""
    from pathlib import Path

    from exactness import PROGRAMS

    script = Path(PROGRAMS) / "ddp_epochs.py"
    plain = client.submit(script, gpus=2, name="epochs-plain")
    assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
    reference = rank_lines(plain)
    assert sorted(reference) == [0, 1] and len(reference[0]) == len(reference[1]) + 4

    seed = int(os.environ.get("EPOCHS_SEED", random.randrange(1 << 30)))
    rnd = random.Random(seed)
    job = client.submit(script, gpus=2, name="epochs-interrupted")
    for ev in job.events():  # the request rides epoch 1's last steps, then rank 0 validates alone
        if any(line.startswith("epoch 1 step 10 ") for line in ev.lines):
            break
    job.preempt(timeout=120)
    job.resume()
    for target, action in zip(sorted(rnd.sample(range(55, 95), 2)), ("resize", "preempt")):
        wait_for_lines(job, target)
        if job.refresh().state != JobState.RUNNING:
            break
        if action == "resize":
            job.resize(1, timeout=120)  # both ranks on one device, taking turns
        else:
            job.preempt(timeout=120)
            job.resume()
    assert job.wait(180) == JobState.SUCCEEDED, f"seed {seed}: {job.info.error}"
    assert rank_lines(job) == reference, f"seed {seed}"
