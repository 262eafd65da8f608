"""The job widget's buttons act while a blocking ``%%singularity`` cell still runs, in a real
ipykernel driven through jupyter_client: the test clicks as a frontend does (comm messages on
the shell channel) from a second thread while the cell's ``execute_request`` is in progress."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from jupyter_helpers import Kernel, cancel_quietly, latest_job, wait_until
from singularity_sdk import JobState

#: An ordinary DDP cell (2 ranks) that prints its loss in the chart's grammar.
DDP_CELL = (Path(__file__).resolve().parents[1] / "e2e" / "programs" / "ddp_train.py").read_text().replace(
    'int(os.environ.get("STEPS", "60"))', "200").replace(
    'print(f"step {step} loss {loss.item()!r}", flush=True)', 'print(f"step={step} loss={loss.item()!r}", flush=True)')
#: The same training, slower per step (the value does not depend on it): time to click.
SLOW_CELL = DDP_CELL.replace('float(os.environ.get("STEP_SLEEP", "0.02"))', "0.06")
TICKS = "import time\nfor i in range(100000):\n    print(f'step={i} loss={1 / (i + 1)}', flush=True)\n    time.sleep(0.02)\n'never'"


class Frontend:
    """Records the widgets a cell opens (from iopub) and clicks them over the shell channel."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.models: dict[str, dict[str, Any]] = {}  # comm id -> initial state
        self.lock = threading.Lock()

    def on_output(self, msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "comm_open":
            with self.lock:
                self.models[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif msg["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            with self.lock:  # classes are added after a widget is made: an update carries them
                self.models.setdefault(content["comm_id"], {}).update(content["data"].get("state", {}))

    def comm(self, match: Callable[[dict], bool]) -> str:
        with self.lock:
            found = [cid for cid, st in self.models.items() if match(st)]
        assert found, "the widget is not shown"
        return found[-1]

    def button(self, action: str) -> str:
        return self.comm(lambda st: f"singularity-{action}" in st.get("_dom_classes", ()))

    def send(self, comm_id: str, data: dict) -> None:
        kc = self.kernel.kc
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))

    def click(self, action: str) -> None:
        self.send(self.button(action), {"method": "custom", "content": {"event": "click"}})

    def set_resize_to(self, n: int) -> None:
        cid = self.comm(lambda st: st.get("_model_name") == "BoundedIntTextModel")
        self.send(cid, {"method": "update", "state": {"value": n}, "buffer_paths": []})


def run_while(kernel: Kernel, code: str, actions: Callable[[Frontend], None], timeout: float):
    """Execute ``code`` and run ``actions`` on another thread while it executes."""
    front = Frontend(kernel)
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            actions(front)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    reply, outputs = kernel.execute(code, timeout=timeout, on_output=front.on_output)
    thread.join(30)
    if errors:
        raise errors[0]
    return reply, outputs


def events(job, kind: str) -> int:
    return sum(e.type.value == kind for e in job.events(follow=False))


def test_preempt_resume_resize_from_the_widget_while_the_cell_runs(kernel, jclient):
    # The undisturbed reference runs beside the cell (the test cluster has 2 nodes x 2 devices).
    plain = jclient.submit(DDP_CELL, gpus=2, ranks=2, name="kb-plain")

    def actions(front: Frontend) -> None:
        wait_until(lambda: any(j.name == "kb-widget" for j in jclient.jobs()), timeout=60, what="the job")
        job = latest_job(jclient, "kb-widget")
        wait_until(lambda: "step=20 " in job.logs(), timeout=120, interval=0.1, what="training")
        front.click("preempt")
        wait_until(lambda: job.refresh().state == JobState.PREEMPTED, timeout=60, interval=0.1, what="preempted")
        front.click("resume")
        wait_until(lambda: events(job, "resumed") >= 1, timeout=60, interval=0.1, what="resumed")
        front.set_resize_to(1)
        front.click("resize")
        wait_until(lambda: events(job, "resized") == 1, timeout=120, interval=0.1, what="resized to 1 device")

    reply, outputs = run_while(kernel, "%%singularity --gpus 2 --ranks 2 --name kb-widget\n" + SLOW_CELL,
                               actions, timeout=300)
    assert reply["status"] == "ok", reply
    job = latest_job(jclient, "kb-widget")
    kinds = [e.type.value for e in job.events(follow=False)]
    assert "preempted" in kinds and "resumed" in kinds and "resized" in kinds
    value = [m["content"]["data"]["text/plain"] for _, m in outputs if m["msg_type"] == "execute_result"]
    assert value == [repr(plain.result(240))]  # the parameters' digest: identical to the undisturbed run


def test_cancel_from_the_widget_ends_the_waiting_cell(kernel, jclient):
    def actions(front: Frontend) -> None:
        wait_until(lambda: any(j.name == "kb-cancel" for j in jclient.jobs()), timeout=60, what="the job")
        job = latest_job(jclient, "kb-cancel")
        wait_until(lambda: "step=3 " in job.logs(), timeout=60, interval=0.1, what="output")
        front.click("cancel")

    reply, outputs = run_while(kernel, "%%singularity --name kb-cancel\n" + TICKS, actions, timeout=120)
    job = latest_job(jclient, "kb-cancel")
    try:
        assert job.refresh().state == JobState.CANCELLED
        assert reply["status"] == "error" and reply["ename"] == "CellJobCancelled", reply
    finally:
        cancel_quietly(job)
