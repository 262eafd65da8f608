"""The training curve: the printed-metrics grammar, ``singularity_sdk.log`` from a real job,
``job.metrics()`` (sync and async) and the widget's chart with a marker at a preemption."""
from __future__ import annotations

import asyncio
import importlib.util
import re

import pytest

from jupyter_helpers import cancel_quietly, magics, wait_until
from singularity_sdk import JobState, log
from singularity_sdk.metrics import parse_line, series_of
from singularity_sdk.protocol import Event, EventType

JOB = """
import singularity_sdk
for i in range(12):
    loss = 1.0 / (i + 1)
    print(f"epoch: 0 step={i} lr=1e-3 loss={loss!r} | val_acc: {i / 12!r}", flush=True)
    singularity_sdk.log(reward=i * 0.5)
'done'
"""


@pytest.mark.parametrize("line, values, step", [
    ("step 3 | loss=0.25, val_acc: 0.91 lr=1e-3", {"loss": 0.25, "val_acc": 0.91}, None),
    ("epoch: 2 step=7 train/loss = 1e-2", {"train/loss": 0.01}, 7),
    ("seed: 0 batch_size=32 lr: 3e-4 warmup=100", {}, None),   # settings, not metrics
    ("at 12:30 loss:-1.5e+2", {"loss": -150.0}, None),
    ("accuracy=0.5x myloss=3 error_rate: 0.1", {"error_rate": 0.1}, None),
    ("iter=4 epoch=1 ppl=12.5", {"ppl": 12.5}, 4),              # step keys: step, global_step, iter, ..., epoch
])
def test_printed_metrics_grammar(line, values, step):
    assert parse_line(line) == (values, step)


def test_superseded_points_are_dropped():
    def ev(seq, type_, **data):
        return Event(job_id="j", seq=seq, type=type_, time=float(seq), data=data)

    events = [ev(1, EventType.LOG, line="loss=3\n"), ev(2, EventType.LOG, line="loss=2\n"),
              ev(3, EventType.LOG, line="loss=1\n"),
              ev(4, EventType.SUPERSEDED, ranks=[0], after_seq=1, before_seq=4),
              ev(5, EventType.LOG, line="loss=2\n"), ev(6, EventType.TELEMETRY, metrics={"loss": 9.0}, rank=1)]
    rows = series_of(events).rows()
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 3.0), (1, 2.0)]  # rank 1 is not rank 0
    assert len(series_of(events, rank=None).rows()) == 3


def test_log_outside_a_job_does_nothing(monkeypatch):
    monkeypatch.delenv("SINGULARITY_CONTROL_FD", raising=False)
    assert log(loss=1.0) is False


def test_metrics_series_equals_the_printed_values(jclient, jcluster):
    job = jclient.submit(JOB, name="metrics")
    assert job.result(120) == "done"
    printed = [line for line in job.logs().splitlines() if "loss=" in line]
    expected = [(int(re.search(r"step=(\d+)", ln)[1]), float(re.search(r"loss=(\S+)", ln)[1]),
                 float(re.search(r"val_acc: (\S+)", ln)[1])) for ln in printed]
    rows = job.metrics()
    from_print = [r for r in rows if r["source"] == "print"]
    assert [(r["step"], r["loss"], r["val_acc"]) for r in from_print] == expected
    assert all("lr" not in r and "epoch" not in r for r in rows)
    assert [(r["step"], r["reward"]) for r in rows if r["source"] == "log"] == [(i, i * 0.5) for i in range(12)]
    assert job.metrics(printed=False) == [r for r in rows if r["source"] == "log"]

    async def via_async():
        async with jcluster.async_client() as c:
            return await (await c.get(job.id)).metrics()

    assert asyncio.run(via_async()) == rows
    if importlib.util.find_spec("pandas") is None:
        with pytest.raises(ImportError, match="needs pandas"):
            job.metrics(as_frame=True)
    else:
        assert job.metrics(as_frame=True).to_dict("records") == rows


def _last_step_drawn(svg: str) -> float:
    """The step at the right end of the chart's x axis (-1 before there is a curve)."""
    if 'class="singularity-curve"' not in svg:
        return -1
    m = re.search(r'>([-0-9.e+]+)</text></svg>$', svg)
    return float(m.group(1)) if m else -1


def test_the_chart_marks_a_preemption(shell, jclient):
    shell.run_line_magic("singularity_config", "--widgets on")
    cell = "import time\nfor i in range(100000):\n    print(f'step={i} loss={1 / (i + 1)}', flush=True)\n    time.sleep(0.02)"
    job = shell.run_cell_magic("singularity", "--no-wait --name charted", cell)
    w = magics(shell).widgets[job.id]
    try:
        # a few steps drawn first: a curve of one point spans no width, and neither would its band
        wait_until(lambda: _last_step_drawn(w.chart.value) >= 3, timeout=60, what="a curve of a few steps")
        job.preempt(timeout=60)
        wait_until(lambda: "singularity-marker-preempted" in w.chart.value, what="a marker at the preemption")
        assert "singularity-devices" in w.chart.value  # the device count shaded under the curve
        assert re.search(r"loss [▁▂▃▄▅▆▇█]+ ", w.view.summary())  # the text form: a sparkline
    finally:
        cancel_quietly(job)
    assert job.state == JobState.CANCELLED


def test_text_output_ends_with_a_sparkline(shell, capsys):
    cell = "for i in range(8):\n    print(f'step={i} loss={1 / (i + 1)} lr=0.1', flush=True)"
    shell.run_cell_magic("singularity", "--name sparkline", cell)  # a plain shell: text output
    assert re.search(r"loss [▁▂▃▄▅▆▇█]{8} 0\.125 @ step 7", capsys.readouterr().out)
    shell.run_line_magic("singularity_config", "--print-metrics off")
    shell.run_cell_magic("singularity", "--name no-sparkline", cell)
    out = capsys.readouterr().out
    assert "step=7 loss=0.125" in out and "@ step" not in out
