"""``%%singularity`` in a real kernel (ipykernel through jupyter_client), as a notebook runs it."""
from __future__ import annotations

import queue
import time

from jupyter_helpers import LONG_LOOP, cancel_quietly, latest_job, stream_text
from singularity_sdk import JobState


def test_result_variables_and_live_output(kernel):
    reply, _ = kernel.execute("base = 10\ndata = [1, 2, 3]")
    assert reply["status"] == "ok"
    code = ("%%singularity --name kernel-vars\n"
            "import time\nprint('first', flush=True)\ntime.sleep(1.0)\nprint('second')\n"
            "y = base * 2\ndata.append(4)\nsum(data) + y")
    reply, outputs = kernel.execute(code)
    assert reply["status"] == "ok", reply
    results = [m["content"]["data"]["text/plain"] for _, m in outputs if m["msg_type"] == "execute_result"]
    assert results == ["30"]
    text = stream_text(outputs, "stdout")
    assert "first\n" in text and "second\n" in text
    first_at = next(t for t, m in outputs if m["msg_type"] == "stream" and "first" in m["content"]["text"])
    done_at = outputs[-1][0]
    assert done_at - first_at > 0.7, "remote output must appear while the job runs, not at its end"
    assert any(m["msg_type"] == "comm_open" for _, m in outputs), "a kernel shows the live widget"
    reply, outputs = kernel.execute("print(y, data)")
    assert stream_text(outputs) == "20 [1, 2, 3, 4]\n"


def test_exception_shows_the_remote_traceback(kernel):
    reply, outputs = kernel.execute("%%singularity\nx = 0\n\ndef ratio(v):\n    return 1 / v\n\nratio(x)")
    assert reply["status"] == "error"
    assert reply["ename"] == "RemoteCellError" and reply["evalue"] == "ZeroDivisionError: division by zero"
    tb = "\n".join(reply["traceback"])
    assert 'File "<cell>", line 7, in <module>' in tb and 'File "<cell>", line 5, in ratio' in tb
    assert "jupyter_ext" not in tb  # the magic's own frames are not shown
    errors = [m for _, m in outputs if m["msg_type"] == "error"]
    assert errors and "return 1 / v" in "\n".join(errors[0]["content"]["traceback"])


def test_ctrl_c_detaches_and_the_widget_keeps_updating(kernel, jclient):
    interrupted = []

    def on_output(msg):
        if not interrupted and msg["msg_type"] == "stream" and "tick 3" in msg["content"]["text"]:
            interrupted.append(time.monotonic())
            kernel.km.interrupt_kernel()

    reply, outputs = kernel.execute("%%singularity --name detached\n" + LONG_LOOP, timeout=60, on_output=on_output)
    assert interrupted, "the job's output never reached the cell"
    assert reply["status"] == "ok", reply  # Ctrl-C detaches: not an error
    assert "detached (Ctrl-C)" in stream_text(outputs)
    job = latest_job(jclient, "detached")
    try:
        assert job.refresh().state == JobState.RUNNING  # the job keeps running
        # The widget keeps following it after the cell returned: its log view is updated from a thread.
        seen = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(seen) < 2:
            try:
                msg = kernel.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg["msg_type"] == "comm_msg":
                value = str(msg["content"]["data"].get("state", {}).get("value", ""))
                if "tick" in value:  # the log view, with newer lines each time
                    seen.add(value[-200:])
        assert len(seen) >= 2, "no widget updates reached the frontend after the cell returned"
    finally:
        cancel_quietly(job)
    assert job.state == JobState.CANCELLED
