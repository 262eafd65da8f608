"""Honest, prompt answers: a preempt, migrate or resize that finds no safe point within its bound
is answered with ``checkpoint_failed`` saying where the job is (file:line, function, library
call), the job runs on, and later moves succeed once it reaches a loop. A job says at start
whether and where it can be interrupted."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from exactness import PROGRAMS, rank_lines, source, stdout_lines, wait_for_lines
from singularity_sdk import EventType, JobState, LocalCluster
from singularity_sdk.errors import CheckpointFailed

BOUND = 2.0
#: what "answers within its bound" allows on top of the bound (a loaded 2-core machine)
SLACK = 12.0
STUCK = "load_everything", "time.sleep"


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """A cluster whose server bounds every move at BOUND seconds (``serve --checkpoint-timeout``)."""
    with LocalCluster(nodes=1, devices_per_node=2, home=tmp_path_factory.mktemp("h"),
                      checkpoint_timeout=BOUND) as c:
        yield c


def _events(job, type_):
    return [e for e in job.events(follow=False) if e.type == type_]


def _line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((PROGRAMS / name).read_text().splitlines(), 1) if text in line)


def test_preempt_inside_a_long_library_call_answers_where_and_runs_on(bounded):
    with bounded.client() as client:
        job = client.submit(source("stuck_then_loop.py"), filename="stuck_then_loop.py",
                            env={"STUCK_S": "8", "STEPS": "40"}, name="stuck")
        wait_for_lines(job, 1)  # "loading": it is inside time.sleep now
        asked = time.monotonic()
        with pytest.raises(CheckpointFailed, match=r"stuck_then_loop\.py:\d+ in load_everything, inside time\.sleep"):
            job.preempt(timeout=BOUND + SLACK + 30)
        answered = time.monotonic() - asked
        assert answered < BOUND + SLACK, f"answered after {answered:.1f} s"
        assert job.refresh().state == JobState.RUNNING
        failed = _events(job, EventType.CHECKPOINT_FAILED)[-1].data
        where = failed["where"]
        assert failed["timeout"] is True
        assert where["file"].endswith("stuck_then_loop.py") and where["function"] == "load_everything"
        assert where["line"] == _line_of("stuck_then_loop.py", "time.sleep(float")
        assert where["library"] == "time.sleep"

        # At start it said it can be interrupted, and where: the top-level loop.
        info = _events(job, EventType.INTERRUPTIBLE)[0].data
        assert info["interruptible"] is True
        loop_line = _line_of("stuck_then_loop.py", "for i in range")
        assert loop_line in [s["line"] for s in info["safe_points"]]

        # Once in its loop it is preempted normally, and the resumed run is exact.
        wait_for_lines(job, 5)
        job.preempt(timeout=60)
        assert job.refresh().state == JobState.PREEMPTED
        job.resume()
        assert job.wait(120) == JobState.SUCCEEDED, job.info.error
        assert job.result() == "done"
        assert stdout_lines(job) == ["loading\n"] + [f"{i}\n" for i in range(40)]



def _fit_of_an_earlier_cell():
    """``fit`` as a notebook cell defines it: a function of ``__main__`` (sent by value)."""
    cell = {"__name__": "__main__"}
    exec("import time\ndef fit(n):\n    total = 0\n    for step in range(n):\n        total += step\n"
         "        print('fit', step, flush=True)\n        time.sleep(0.05)\n    return total\n", cell)
    return cell["fit"]


def test_a_loop_in_a_function_of_an_earlier_cell_is_named_with_what_to_do(bounded):
    """The commonest notebook shape: a training function defined in an earlier cell, called by
    the %%singularity cell. It travels as a variable, without source, so its loop has no safe
    point; the answer must say so and what to do, not only where the job is."""
    with bounded.client() as client:
        job = client.submit("result = fit(400)\nresult", inputs={"fit": _fit_of_an_earlier_cell()},
                            outputs=["result"], filename="<cell>", name="earlier-cell")
        wait_for_lines(job, 3)
        with pytest.raises(CheckpointFailed, match=r"fit\(\) came with the job's variables .* define it in the cell"):
            job.preempt(timeout=BOUND + SLACK + 30)
        assert job.refresh().state == JobState.RUNNING
        job.cancel()
        job.wait(30)

def test_resize_of_a_data_parallel_job_stuck_in_a_library_call_answers_and_runs_on(bounded):
    name = "ddp_stuck_then_loop.py"
    env = {"STUCK_S": "10", "STEPS": "60"}
    with bounded.client() as client:
        plain = client.submit(source(name), filename=name, gpus=2, env={"STEPS": "60"}, name="ddp-plain")
        assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
        job = client.submit(source(name), filename=name, gpus=2, env=env, name="ddp-stuck")
        wait_for_lines(job, 2)  # both ranks are warming up
        asked = time.monotonic()
        with pytest.raises(CheckpointFailed, match=r"ddp_stuck_then_loop\.py:\d+ in warm_up, inside time\.sleep"):
            job.resize(1, timeout=BOUND + SLACK + 30, checkpoint_timeout=BOUND)  # a per-request bound
        assert time.monotonic() - asked < BOUND + SLACK
        job.refresh()
        assert job.state == JobState.RUNNING and job.info.gpus == 2
        assert sum(len(p.devices) for p in job.info.placement) == 2
        failed = [e.data for e in _events(job, EventType.CHECKPOINT_FAILED)]
        assert all(f["where"]["function"] == "warm_up" for f in failed)
        assert {f["rank"] for f in failed} <= {0, 1}

        # In its loop, the same resize succeeds, and every rank's output equals the plain run's.
        wait_for_lines(job, 12)
        job.resize(1, timeout=120)
        assert job.refresh().state == JobState.RUNNING
        assert sum(len(p.devices) for p in job.info.placement) == 1
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert rank_lines(job) == rank_lines(plain) and job.result() == plain.result() == "ok"
        assert not [e for e in job.events(follow=False) if e.type == EventType.RESIZING and
                    e.time > _events(job, EventType.RESIZED)[-1].time]


def test_start_event_says_where_a_job_can_be_interrupted(bounded):
    code = ("import time\n"
            "def main():\n"
            "    for step in range(3):\n"
            "        time.sleep(0.01)\n"
            "\n"
            "if __name__ == '__main__':\n"
            "    main()\n")
    with bounded.client() as client:
        job = client.submit(code, filename="train_main.py", name="in-main")
        assert job.wait(60) == JobState.SUCCEEDED, job.info.error
        info = _events(job, EventType.INTERRUPTIBLE)[0].data
        safe = [s["line"] for s in info["safe_points"]]
        missed = [s["line"] for s in info["not_safe_points"]]
        # Whatever the rewrite instruments, the report agrees with it: the loop at line 3 is
        # listed exactly once, and a job without a safe-point loop says where its loops run.
        assert sorted(safe + missed) == [3]
        # `singularityctl show` tells it too
        env = {**os.environ, "SINGULARITY_HOME": str(bounded.home)}
        env.pop("SINGULARITY_URL", None)
        env.pop("SINGULARITY_TOKEN", None)
        shown = subprocess.run([sys.executable, "-m", "singularity_sdk.cli", "show", job.id], env=env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert f"interruptible: {info['message']}" in shown.stdout
        if missed:
            assert info["interruptible"] is False
            assert "line(s) 3 (in main)" in info["message"] and "called from line(s) 7" in info["message"]
        else:
            assert info["interruptible"] is True and info["safe_points"][0]["function"] == "main"


def test_a_request_the_ranks_agreed_on_too_late_is_not_acted_on(bounded, tmp_path):
    """The request reaches a safe point and spreads to every rank through their allreduce, then
    the ranks get stuck before the next one: after the bound they answer checkpoint_failed and,
    when they reach a safe point again, all of them take no checkpoint (none stops alone)."""
    name = "ddp_stuck_after_marker.py"
    marker = tmp_path / "go"
    with bounded.client() as client:
        plain = client.submit(source(name), filename=name, gpus=2, env={"STEPS": "20", "MARKER": str(marker)},
                              name="ddp-plain-marker")
        assert plain.wait(180) == JobState.SUCCEEDED, plain.info.error
        job = client.submit(source(name), filename=name, gpus=2, name="ddp-agreed",
                            env={"STEPS": "20", "MARKER": str(marker), "STUCK_S": "8"})
        wait_for_lines(job, 4)
        marker.write_text("")
        deadline = time.monotonic() + 60
        while not marker.with_name("go.ack").exists():  # the ranks passed this step's safe point
            assert time.monotonic() < deadline
            time.sleep(0.02)
        asked = time.monotonic()
        with pytest.raises(CheckpointFailed, match="ddp_stuck_after_marker"):
            job.resize(1, timeout=BOUND + SLACK + 30, checkpoint_timeout=BOUND)
        assert time.monotonic() - asked < BOUND + SLACK
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert rank_lines(job) == rank_lines(plain)
        failed = _events(job, EventType.CHECKPOINT_FAILED)
        assert any(e.data.get("stage") == "agreement" for e in failed), [e.data for e in failed]
        assert not _events(job, EventType.CHECKPOINTED) and not _events(job, EventType.RESIZED)


def test_a_request_sets_its_own_bound_from_the_cli_and_the_async_sdk(bounded):
    """The server bounds moves at BOUND; `--checkpoint-timeout` / ``checkpoint_timeout=`` on one
    request sets its own, which the failure event reports."""
    import asyncio

    from singularity_sdk import AsyncClient

    with bounded.client() as client:
        job = client.submit(source("stuck_then_loop.py"), filename="stuck_then_loop.py",
                            env={"STUCK_S": "30", "STEPS": "5"}, name="own-bound")
        wait_for_lines(job, 1)  # inside time.sleep
        env = {**os.environ, "SINGULARITY_HOME": str(bounded.home)}
        env.pop("SINGULARITY_URL", None)
        env.pop("SINGULARITY_TOKEN", None)
        cli = subprocess.run([sys.executable, "-m", "singularity_sdk.cli", "preempt", job.id,
                              "--checkpoint-timeout", "1.5"], env=env, capture_output=True, text=True, timeout=120)
        assert cli.returncode != 0 and "load_everything" in cli.stdout + cli.stderr, cli.stdout + cli.stderr
        assert job.refresh().state == JobState.RUNNING

        async def preempt_async() -> None:
            async with AsyncClient(home=bounded.home) as aclient:
                ajob = await aclient.get(job.id)
                with pytest.raises(CheckpointFailed, match="load_everything"):
                    await ajob.preempt(checkpoint_timeout=1.0, timeout=60)

        asyncio.run(preempt_async())
        bounds = [e.data["bound_s"] for e in _events(job, EventType.CHECKPOINT_FAILED) if "bound_s" in e.data]
        assert bounds[-2:] == [1.5, 1.0], bounds
        job.cancel()
