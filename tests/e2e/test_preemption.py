"""Preempt at random moments, resume, compare with an uninterrupted run: identical, line for line."""
from __future__ import annotations

import signal
import os
import time

import pytest

from exactness import assert_retried_from_a_checkpoint, preempt_and_resume, random_stops, run_interrupted, run_plain, source, stdout_lines, wait_for_lines
from backend.proxy.checkpoint.store import HOLD_HOOK_ENV
from singularity_sdk import CheckpointFailed, EventType, JobState
from singularity_sdk.errors import Conflict

CASES = {
    "dataloader-w0": ("dataloader_train.py", {"LOADER_WORKERS": "0"}),
    "dataloader-w2": ("dataloader_train.py", {"LOADER_WORKERS": "2"}),
    "while-rng": ("while_rng.py", {}),
    "steady-long": ("steady_rng.py", {"STEPS": "200"}),  # ~10 s: outlives checkpoints written behind it
    "defined-things": ("defined_things.py", {}),
}


@pytest.fixture(scope="module")
def reference(cluster):
    """Each program's uninterrupted output, computed once."""
    cache = {}

    def get(case: str):
        if case not in cache:
            name, env = CASES[case]
            with cluster.client() as c:
                cache[case] = run_plain(c, source(name), env)
        return cache[case]
    return get


@pytest.mark.parametrize("case,seed", [("dataloader-w0", 1), ("dataloader-w0", 2), ("dataloader-w2", 3),
                                       ("while-rng", 4), ("while-rng", 5), ("defined-things", 6)])
def test_random_preemptions_resume_exactly(client, reference, case, seed):
    expected_lines, expected_result = reference(case)
    name, env = CASES[case]
    stops = random_stops(seed, len(expected_lines), 2)
    job, lines, result = run_interrupted(client, source(name), stops, preempt_and_resume, env)
    assert lines == expected_lines
    assert result == expected_result
    types = [e.type for e in job.events(follow=False)]
    assert types.count(EventType.PREEMPTED) >= 1 and types.count(EventType.RESUMED) >= 1


def test_preempted_in_first_iteration_between_loops_and_in_the_last(client, reference):
    expected_lines, expected_result = reference("while-rng")
    # 0 lines: before the first iteration ends; 40: where the while loop hands over to the for
    # loop; len-2: inside the last iteration.
    stops = [0, 40, len(expected_lines) - 2]
    job, lines, result = run_interrupted(client, source("while_rng.py"), stops, preempt_and_resume)
    assert lines == expected_lines and result == expected_result


def test_five_preemptions_in_one_run(client, reference, cluster):
    """... and from the third on, each commit prunes the oldest checkpoint without waiting for its
    removal: the folder is renamed out of sight, and what the exiting worker left is removed by
    its agent before the job resumes (docs/checkpoint-format.md, commit protocol)."""
    expected_lines, expected_result = reference("dataloader-w0")
    stops = random_stops(11, len(expected_lines), 5)
    kept: list[int] = []

    def preempt_then_look(job, i):
        job.preempt(timeout=60)
        folder = cluster.home / "checkpoints" / job.id
        deadline = time.monotonic() + 30  # a liveness bound for the agent's removal, not a timing claim
        while list(folder.glob(".*.pruned")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not list(folder.glob(".*.pruned")), sorted(p.name for p in folder.iterdir())
        kept.append(len(list(folder.glob("ckpt-*"))))
        if job.state == JobState.PREEMPTED:
            job.resume()

    job, lines, result = run_interrupted(client, source("dataloader_train.py"), stops, preempt_then_look,
                                         {"LOADER_WORKERS": "0"})
    assert lines == expected_lines and result == expected_result
    assert [e.type for e in job.events(follow=False)].count(EventType.RESUMED) >= 3
    assert len(kept) >= 3 and kept[-1] == 2, kept


def _loop_fn(n, scale):
    import random as _random

    rng = _random.Random(7)
    out = []
    for i in range(n):
        out.append(rng.random() * scale)
        print(f"fn {i} {out[-1]:.12f}", flush=True)
        import time as _t
        _t.sleep(0.03)
    return sum(out)


def test_submitted_callable_with_loops(client):
    plain = client.submit(_loop_fn, 30, 2.0)
    expected = plain.result(timeout=120)
    expected_lines = stdout_lines(plain)
    job = client.submit(_loop_fn, 30, 2.0)
    wait_for_lines(job, 10)
    preempt_and_resume(job, 0)
    assert job.result(timeout=120) == expected
    assert stdout_lines(job) == expected_lines


def _make_counter_trainer(scale, steps):
    """A factory's closure: its state (``weights``, ``seen``) lives in cells, not in its locals."""
    weights = [1.0, -0.5]
    seen = []

    def run(seed):
        import random as _random
        import time as _t

        rng = _random.Random(seed)
        for i in range(steps):
            weights[0] = weights[0] * 0.9 + rng.random() * scale
            weights[1] += weights[0] / 7
            seen.append(round(weights[1], 12))
            print(f"closure {i} {seen[-1]!r}", flush=True)
            _t.sleep(0.03)
        return seen, weights

    return run


def test_a_submitted_closure_resumes_with_its_cells_as_they_were(client):
    """The cells of a submitted closure came back as submitted, not as at the checkpoint: the run
    went on from the initial weights after a restore, silently."""
    plain = client.submit(_make_counter_trainer(0.5, 24), 3)
    expected = plain.result(timeout=120)
    job = client.submit(_make_counter_trainer(0.5, 24), 3)
    wait_for_lines(job, 8)
    preempt_and_resume(job, 0)
    assert job.result(timeout=120) == expected
    assert stdout_lines(job) == stdout_lines(plain)


def test_resume_on_the_other_node(client, reference, cluster):
    expected_lines, expected_result = reference("defined-things")
    job = client.submit(source("defined_things.py"))
    wait_for_lines(job, 8)
    first_node = job.refresh().placement[0].node
    job.preempt()
    # Fill the first node so the job can only resume on the other one.
    blockers = [client.submit("import time; time.sleep(20)", gpus=2, name="blocker")]
    time.sleep(0.5)
    job.resume()
    assert job.wait(120) == JobState.SUCCEEDED
    resumed = [e for e in job.events(follow=False) if e.type == EventType.RESUMED]
    assert resumed and resumed[-1].data["node"] != first_node
    assert stdout_lines(job) == expected_lines and job.result() == expected_result
    for b in blockers:
        b.cancel()


def test_checkpoint_now_keeps_running(client):
    job = client.submit("import time\nfor i in range(40):\n    print(i, flush=True)\n    time.sleep(0.05)\n", name="ck")
    wait_for_lines(job, 3)
    job.checkpoint(timeout=60)
    events = list(job.events(follow=False))
    ck = [e for e in events if e.type == EventType.CHECKPOINTED]
    assert ck and ck[-1].data["bytes"] > 0 and ck[-1].data["step"] >= 1
    assert job.wait(120) == JobState.SUCCEEDED
    assert stdout_lines(job) == [f"{i}\n" for i in range(40)]


def test_open_socket_gives_a_clear_error_and_the_job_finishes(client):
    code = ("import socket, time\nfor step in range(30):\n    if step == 0:\n        sock = socket.socket()\n"
            "    print(step, flush=True)\n    time.sleep(0.05)\nsock.close()\n'finished'")
    job = client.submit(code, name="socket")
    wait_for_lines(job, 3)
    with pytest.raises(CheckpointFailed) as info:
        job.preempt(timeout=60)
    assert "sock" in str(info.value) and "socket" in str(info.value)
    assert job.refresh().state == JobState.RUNNING
    assert job.result(timeout=120) == "finished"
    assert stdout_lines(job) == [f"{i}\n" for i in range(30)]
    failed = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINT_FAILED]
    assert failed and any(v[0] == "sock" for v in failed[0].data.get("variables", []))


def test_preempt_and_resume_in_wrong_states_are_conflicts(client):
    job = client.submit("1")
    job.wait(60)
    with pytest.raises(Conflict, match="only a running job"):
        job.preempt()
    with pytest.raises(Conflict, match="only a preempted job"):
        job.resume()


def test_worker_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(client, reference, tmp_path):
    expected_lines, expected_result = reference("steady-long")
    # while the gate exists, a write waits half-way; the job runs on meanwhile (checkpoints are
    # written behind it)
    gate = tmp_path / "hold-the-write"
    env = {HOLD_HOOK_ENV: str(gate), **CASES["steady-long"][1]}
    job = client.submit(source("steady_rng.py"), env=env, name="killed-mid-write")
    wait_for_lines(job, 5)
    job.checkpoint(timeout=60)  # a good one
    pid = next(int(p) for e in job.events(follow=False) if e.type == EventType.STARTED for p in e.data["pids"].values())
    since = job.refresh().info.last_seq
    gate.touch()
    job.act("checkpoint")
    for ev in job.events(since=since):  # half-way through writing the second checkpoint
        if any("test hook: holding a checkpoint write" in line for line in ev.lines):
            break
    os.kill(pid, signal.SIGKILL)
    gate.unlink()  # the retry's writes go through
    assert_retried_from_a_checkpoint(job, expected_lines, expected_result)
    first = next(e.data["step"] for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED)
    retry = next(e.data for e in job.events(follow=False) if e.type == EventType.RETRYING)
    assert retry["from_step"] == first, "the checkpoint held half-way was never restored"
