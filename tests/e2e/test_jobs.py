"""Submit code and watch it run: results, logs, tracebacks, callables, scripts, cancel."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from singularity_sdk import EventType, JobCancelled, JobFailed, JobState
from processes import pid_alive


def test_hello_result_logs_and_events(client):
    job = client.submit("print('hi'); 6 * 7", gpus=1)
    assert job.wait(60) == JobState.SUCCEEDED
    assert job.result() == 42
    assert job.logs() == "hi\n"
    types = [ev.type for ev in job.events()]
    assert types[0] == EventType.SUBMITTED
    for expected in (EventType.SCHEDULED, EventType.STARTED, EventType.LOG, EventType.SUCCEEDED):
        assert expected in types
    assert types[-1] == EventType.SUCCEEDED
    assert types.index(EventType.SCHEDULED) < types.index(EventType.STARTED) < types.index(EventType.LOG)
    seqs = [ev.seq for ev in job.events(follow=False)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert job.placement and job.placement[0].node.startswith("node-")


def test_exception_fails_with_traceback_into_submitted_code(client):
    code = "x = 1\n\ndef boom(v):\n    return v / 0\n\nboom(x)\n"
    job = client.submit(code, name="boom")
    assert job.wait(60) == JobState.FAILED
    err = job.info.error
    assert 'File "<cell>", line 6, in <module>' in err
    assert 'File "<cell>", line 4, in boom' in err
    assert "return v / 0" in err and "ZeroDivisionError" in err
    assert "backend/worker" not in err  # the worker's own frames are not shown
    with pytest.raises(JobFailed, match="ZeroDivisionError"):
        job.result()


def test_a_program_exiting_with_the_stop_status_fails_instead_of_resuming_forever(client):
    """``sys.exit(75)`` (EX_TEMPFAIL) is the status a rank stopped at a checkpoint exits with: the
    job was queued again and resumed from its last checkpoint, again and again."""
    job = client.submit("import sys\nprint('done')\nsys.exit(75)\n", name="tempfail")
    assert job.wait(60) == JobState.FAILED
    assert "sys.exit(75)" in job.info.error and "stop at a checkpoint" in job.info.error
    assert job.logs() == "done\n"
    assert not any(ev.type == EventType.RESUMED for ev in job.events(follow=False))


def test_script_file(client, tmp_path):
    script = tmp_path / "train_step.py"
    script.write_text("import sys\ntotal = sum(range(10))\nprint('total', total)\nraise ValueError(f'bad {total}')\n")
    job = client.submit(script)
    assert job.name == "train_step"
    assert job.wait(60) == JobState.FAILED
    assert f'File "{script}", line 4' in job.info.error  # as `python /path/train_step.py` shows it
    assert job.logs().startswith("total 45\n")


def _power(base, exp, *, scale=1):
    return scale * base ** exp


PICKLES_ITS_OWN_CLASSES = """
import dataclasses, io, pickle
import torch

@dataclasses.dataclass
class Record:
    step: int
    loss: float

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

data = pickle.dumps([Record(0, 1.0)])
torch.save(Net(), io.BytesIO())  # the whole model: its class by reference, as `python train.py` saves it
pickle.loads(data)[0].step
"""


def test_a_job_pickles_objects_of_the_classes_it_defines_by_reference(client):
    """``pickle.dump`` of a dataclass defined in the job, ``torch.save(model)``: pickle looks the
    class up as ``__main__.Record``, which must be the job's (it failed: no such attribute)."""
    job = client.submit(PICKLES_ITS_OWN_CLASSES)
    assert job.wait(60) == JobState.SUCCEEDED, job.info.error
    assert job.result() == 0


def test_callable_with_args_and_closure(client):
    job = client.submit(_power, 2, 10, kwargs={"scale": 3})
    assert job.result(timeout=60) == 3072
    offset = 5
    job = client.submit(lambda xs: [x + offset for x in xs], [1, 2, 3])
    assert job.result(timeout=60) == [6, 7, 8]



def test_a_result_leaves_the_callers_own_class_as_it_was(client, tmp_path, monkeypatch):
    """A bound method of a class in the submitter's own module, submitted, returns an instance of
    that class. Loading the result must not set the class's methods again from the job's copy
    (cloudpickle's do: their code then says ``<dynamic-code>``): ``inspect.getsource`` kept
    working, and the same method submitted again still has its safe points."""
    import importlib
    import inspect

    (tmp_path / "own_trainer.py").write_text(
        "class Trainer:\n"
        "    def __init__(self, steps):\n"
        "        self.steps, self.log = steps, []\n"
        "    def fit(self, scale=1):\n"
        "        for i in range(self.steps):\n"
        "            self.log.append(i * scale)\n"
        "        return self\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    own = importlib.import_module("own_trainer")
    fit = own.Trainer.fit
    first = client.submit(own.Trainer(3).fit, kwargs={"scale": 2}).result(timeout=60)
    assert type(first) is own.Trainer and first.log == [0, 2, 4]
    assert own.Trainer.fit is fit
    assert "self.log.append" in inspect.getsource(own.Trainer.fit)
    again = client.submit(own.Trainer(2).fit)
    assert again.result(timeout=60).log == [0, 1]
    (report,) = [e.data for e in again.events(follow=False) if e.type == EventType.INTERRUPTIBLE]
    assert report["interruptible"] and report["loops"] == 1, report

def test_torch_job_runs_with_fixed_threads(client):
    job = client.submit("import torch, os\n(torch.get_num_threads(), os.environ['CUDA_VISIBLE_DEVICES'], "
                        "int(os.environ['WORLD_SIZE']), torch.ones(3).sum().item())")
    assert job.result(timeout=60) == (1, "", 1, 3.0)


def test_jobs_hash_strings_with_a_fixed_salt_or_the_one_they_ask_for(client):
    """A set of strings iterates in the same order in every process of a job (its restores): the
    salt is 0 unless the job's environment names another, which a fresh interpreter then uses."""
    code = "import os\n(os.environ['PYTHONHASHSEED'], hash('singularity'))"
    expected = {seed: int(subprocess.run([sys.executable, "-c", "print(hash('singularity'))"], text=True,
                                         capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
                for seed in ("0", "5")}
    assert client.submit(code).result(timeout=60) == ("0", expected["0"])
    assert client.submit(code, env={"PYTHONHASHSEED": "5"}).result(timeout=60) == ("5", expected["5"])


def test_a_cpu_slot_pins_its_job_to_the_slots_cores(client):
    from backend.agent.devices import slot_cores

    job = client.submit("import os\nsorted(os.sched_getaffinity(0))")
    cores = job.result(timeout=60)
    (slot,) = job.info.placement[0].devices
    assert cores == slot_cores(slot, 2)  # the test cluster's nodes have two slots each


def test_cancel_running_infinite_loop_kills_it_without_waiting_for_a_safe_point(client):
    job = client.submit("print('looping', flush=True)\nwhile True:\n    pass\n", name="spin")
    pid = None
    for ev in job.events():
        if ev.type == EventType.STARTED:
            pid = int(next(iter(ev.data["pids"].values())))
        if ev.type == EventType.LOG:
            break
    assert pid and pid_alive(pid)
    # no checkpoint, no wait for a safe point: the worker is killed (in ~0.1 s on a quiet machine;
    # the bounds below are liveness, not timing claims)
    job.cancel("test")
    assert job.wait(10) == JobState.CANCELLED
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(pid)
    with pytest.raises(JobCancelled):
        job.result()
    assert client.get(job.id).state == JobState.CANCELLED


def test_cancel_queued_job(client):
    blockers = [client.submit("import time; time.sleep(3)", gpus=2) for _ in range(2)]
    queued = client.submit("print('never')", gpus=4)
    assert queued.refresh().state == JobState.QUEUED
    queued.cancel()
    assert queued.state == JobState.CANCELLED
    for b in blockers:
        b.cancel()
        b.wait(10)
    assert queued.logs() == ""


def test_twenty_jobs_on_four_devices_never_share_a_device(client):
    jobs = [client.submit(f"import time\ntime.sleep(0.1)\nprint({i})\n{i}", name=f"many-{i}") for i in range(20)]
    assert [j.result(timeout=120) for j in jobs] == list(range(20))
    intervals: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for job in jobs:
        events = list(job.events(follow=False))
        scheduled = next(e for e in events if e.type == EventType.SCHEDULED)
        ended = next(e for e in events if e.type == EventType.SUCCEEDED)
        for p in scheduled.data["placement"]:
            for d in p["devices"]:
                intervals.setdefault((p["node"], d), []).append((scheduled.time, ended.time, job.id))
    assert len(intervals) == 4  # every device was used
    for device, spans in intervals.items():
        spans.sort()
        for (s1, e1, j1), (s2, e2, j2) in zip(spans, spans[1:]):
            assert e1 <= s2, f"{j1} and {j2} overlapped on {device}"


def test_event_stream_resumes_with_since_without_gap_or_duplicate(client):
    job = client.submit("import time\nfor i in range(120):\n    print('line', i)\n    time.sleep(0.005)\n")
    seen = []
    for ev in job.events():
        seen.append(ev)
        if len(seen) == 40:
            break  # the socket is closed mid-stream
    for ev in job.events(since=seen[-1].seq):
        seen.append(ev)
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert seen[-1].type == EventType.SUCCEEDED
    lines = [line for e in seen for line in e.lines]
    assert lines == [f"line {i}\n" for i in range(120)]


def test_async_client_same_shape(cluster):
    async def go():
        async with cluster.async_client() as ac:
            job = await ac.submit("print('async'); 'ok'")
            assert await job.wait(60) == JobState.SUCCEEDED
            assert await job.result() == "ok"
            assert await job.logs() == "async\n"
            types = [ev.type async for ev in job.events()]
            assert types[-1] == EventType.SUCCEEDED
            again = await ac.get(job.id)
            assert again.state == JobState.SUCCEEDED
            assert job.id in [j.id for j in await ac.jobs()]
            assert len(await ac.nodes()) == 2
    asyncio.run(go())


def test_multi_rank_job_lines_carry_rank(client):
    job = client.submit("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n", gpus=2)
    assert job.wait(60) == JobState.SUCCEEDED
    lines = sorted(job.logs().splitlines())
    assert lines == ["[rank 0] rank 0 of 2", "[rank 1] rank 1 of 2"]
    assert sum(len(p.devices) for p in job.placement) == 2


def test_inputs_in_outputs_back(client):
    import torch

    weights = torch.arange(4.0)
    job = client.submit("scaled = weights * factor\nlabel = f'x{factor}'\nimport threading\nlock = threading.Lock()\n"
                        "scaled.sum().item()", inputs={"weights": weights, "factor": 3},
                        outputs=["scaled", "label", "lock", "never_assigned"])
    assert job.result(timeout=60) == 18.0
    with pytest.warns(UserWarning, match="lock: lock cannot be pickled"):
        outs = job.outputs()
    assert set(outs) == {"scaled", "label"}
    assert torch.equal(outs["scaled"], weights * 3) and outs["label"] == "x3"


def test_unpicklable_input_is_named(client):
    import threading

    from singularity_sdk import InvalidRequest

    with pytest.raises(InvalidRequest, match="lock"):
        client.submit("1", inputs={"lock": threading.Lock(), "ok": 1})


def test_async_follow_gives_every_event_once_in_batches_and_ends_with_the_job(cluster):
    from singularity_sdk import AsyncClient

    async def follow() -> list:
        async with AsyncClient(cluster.url, cluster.token) as aclient:
            job = await aclient.submit("import time\nfor i in range(30):\n    print('line', i)\n    time.sleep(0.02)\n7")
            seen = []
            async for batch in job.follow(tick_s=0.1):
                seen.extend(batch)
            return seen

    seen = asyncio.run(follow())
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1)) and seen[-1].type == EventType.SUCCEEDED
    assert [line for e in seen for line in e.lines] == [f"line {i}\n" for i in range(30)]


def test_a_batched_stream_sends_each_commit_as_one_frame(cluster, client):
    """``?batch=1`` (what the SDK asks for): the backlog is one JSON array, and a chatty job's
    lines come several to a frame; without it, one event per frame, as before."""
    import json

    from singularity_sdk.protocol import log_lines

    from websockets.sync.client import connect

    job = client.submit("import time\ntime.sleep(1)\nfor i in range(300):\n    print(i, flush=True)\n")
    url = cluster.url.replace("http", "ws") + f"/api/v1/jobs/{job.id}/events/ws?since=0"
    headers = {"Authorization": f"Bearer {cluster.token}"}
    with connect(url + "&batch=1", additional_headers=headers) as ws:
        frames = []
        while not frames or frames[-1][-1]["type"] not in ("succeeded", "failed"):
            frames.append(json.loads(ws.recv(timeout=60)))
    assert all(isinstance(f, list) and f for f in frames)
    events = [e for f in frames for e in f]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    lines = [line for e in events if e["type"] == "log" for line in log_lines(e["data"]["line"])]
    assert lines == [f"{i}\n" for i in range(300)]
    assert len(frames) < len(lines) / 2  # live lines came together, not one frame each
    with connect(url, additional_headers=headers) as ws:  # after the end: the whole backlog
        single = [json.loads(ws.recv(timeout=10)) for _ in events]
    assert single == events
    assert [e.seq for e in job.events()] == [e["seq"] for e in events]  # the SDK reads batches
