"""``%%singularity`` through an in-process IPython shell against a real LocalCluster."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from jupyter_helpers import LONG_LOOP, cancel_quietly, magics, wait_until
from jupyter_ext.results import RemoteCellError
from singularity_sdk import Job, JobState


def test_result_variables_and_output_come_back(shell, capsys, monkeypatch):
    # In CI mode: plain text even though widgets were asked for.
    monkeypatch.setenv("SINGULARITY_NONINTERACTIVE", "1")
    shell.run_line_magic("singularity_config", "--widgets on")
    widgets_before = set(magics(shell).widgets)
    shell.user_ns.update(base=10, data=[1, 2, 3], label="run")
    value = shell.run_cell_magic("singularity", "--name vars -o vjob",
                                 "print('hello from', label)\ny = base * 2\ndata.append(4)\n"
                                 "def double(v):\n    return 2 * v\nsum(data) + y")
    assert value == 30
    assert shell.user_ns["y"] == 20
    assert shell.user_ns["data"] == [1, 2, 3, 4]   # changed in place on the cluster, brought back
    assert shell.user_ns["double"](21) == 42       # functions defined in the cell come back too
    out = capsys.readouterr().out
    assert "\nhello from run\n" in out and "scheduled on node-" in out and "succeeded" in out
    assert set(magics(shell).widgets) == widgets_before
    job = shell.user_ns["vjob"]
    assert isinstance(job, Job) and job.name == "vars" and job.state == JobState.SUCCEEDED



def test_pulled_variables_leave_the_notebooks_own_classes_as_they_were(shell):
    """A class defined in a local cell travels to the cluster by value and comes back with the
    cell's variables; the notebook's class must stay the object it was, its methods included
    (cloudpickle would set them again from the job's copy, whose code has no source), while
    what the cell changed in it (a counter in a class attribute) comes back."""
    shell.run_cell("class Tally:\n    made = 0\n    def __init__(self):\n        self.seen = []\n"
                   "        Tally.made += 1\n"
                   "    def add(self, v):\n        self.seen.append(v)\n        return self\n")
    cls = shell.user_ns["Tally"]
    add = cls.add
    assert shell.run_cell_magic("singularity", "", "t = Tally()\nfor i in range(3):\n    t.add(i)\nlen(t.seen)") == 3
    assert shell.user_ns["Tally"] is cls and cls.add is add
    assert type(shell.user_ns["t"]) is cls and shell.user_ns["t"].seen == [0, 1, 2]
    assert cls.made == 1  # what the cell changed in the class comes back, as if it had run here


def test_functions_of_earlier_cells_read_and_write_the_cells_namespace(shell):
    """A function defined in a local cell reads the notebook's globals where it is called. Run in
    a %%singularity cell it must read the cell's (a rebound ``decay``), and what it appends to a
    global list must be the list the cell sees and brings back, as if the cell had run here."""
    shell.run_cell("decay = 0.9\nhistory = []\ndef lr_at(s):\n    return round(decay ** s, 6)\n"
                   "def log(v):\n    history.append(v)\n    return len(history)\n")
    cell = "out = []\nfor step in range(4):\n    if step == 2:\n        decay = 0.5\n    out.append((lr_at(step), log(step)))\n" \
           "(out, len(history))"
    expected = [(1.0, 1), (0.9, 2), (0.25, 3), (0.125, 4)], 4
    assert shell.run_cell_magic("singularity", "", cell) == expected
    assert shell.user_ns["history"] == [0, 1, 2, 3] and shell.user_ns["decay"] == 0.5


def test_a_notebook_class_stays_the_class_of_its_objects_across_a_preempted_cell(shell):
    """A model of a class from a local cell, trained in a %%singularity cell that is preempted
    and resumed: what comes back must still be an instance of the notebook's class (the
    restored job must keep the class's cloudpickle identity), as without the preemption."""
    from exactness import preempt_and_resume

    shell.run_cell("class Net:\n    def __init__(self):\n        self.steps = 0\n")
    shell.run_cell("model = Net()")
    before = magics(shell).last_job
    done = threading.Event()

    def preempt_once_it_prints() -> None:
        while not done.is_set():
            job = magics(shell).last_job
            if job is not None and job is not before and \
                    any(e.type.value == "log" for e in job.events(follow=False)):
                preempt_and_resume(job, 0)
                return
            done.wait(0.05)

    watcher = threading.Thread(target=preempt_once_it_prints, daemon=True)
    watcher.start()
    try:
        cell = "import time\nfor i in range(40):\n    model.steps += 1\n    print('step', i, isinstance(model, Net), flush=True)\n" \
               "    time.sleep(0.05)\nmodel.steps"
        assert shell.run_cell_magic("singularity", "", cell) == 40  # the cell uses Net: it travels with it
    finally:
        done.set()
        watcher.join(60)
    job = magics(shell).last_job
    assert any(e.type.value == "resumed" for e in job.events(follow=False))
    assert type(shell.user_ns["model"]) is shell.user_ns["Net"] and shell.user_ns["model"].steps == 40

def test_no_pull_and_the_pull_limit(shell, capsys):
    for name in ("fresh", "blob"):
        shell.user_ns.pop(name, None)
    code = "fresh = 1\nblob = b'x' * 100_000\nlen(blob) + fresh"
    assert shell.run_cell_magic("singularity", "--no-pull -o pulled", code) == 100_001
    assert "fresh" not in shell.user_ns and "blob" not in shell.user_ns
    shell.run_line_magic("singularity_config", "--pull-limit-mb 0.01")
    assert shell.run_line_magic("singularity", "attach pulled --wait") == 100_001
    assert "blob" not in shell.user_ns
    assert "over the pull limit of 0.01 MB" in capsys.readouterr().err
    shell.run_line_magic("singularity_config", "--pull-limit-mb 1")
    shell.run_line_magic("singularity", "attach pulled --wait")
    assert shell.user_ns["fresh"] == 1 and len(shell.user_ns["blob"]) == 100_000


def test_exception_shows_the_remote_traceback(shell, capsys):
    result = shell.run_cell("%%singularity\nx = 1\n\ndef boom(v):\n    raise ValueError('bad batch ' + str(v + 41))\n\nboom(x)")
    err = result.error_in_exec
    assert isinstance(err, RemoteCellError) and str(err) == "ValueError: bad batch 42"
    rendered = "\n".join(err._render_traceback_())
    # line numbers as the notebook shows them: line 1 is the %%singularity line
    assert 'File "<cell>", line 7, in <module>' in rendered and 'File "<cell>", line 5, in boom' in rendered
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "raise ValueError('bad batch ' + str(v + 41))" in text and "remote traceback" in text
    assert text.count("Traceback (most recent call last)") == 1  # the stderr copy is not printed twice


@pytest.mark.parametrize("line, needle", [
    ("--sla gold", "invalid choice: 'gold' (choose from 'premium', 'standard', 'basic')"),
    ("--on-interrupt ignore", "choose from 'detach', 'cancel', 'preempt'"),
    ("--gpus 0", "expected a whole number >= 1"),
    ("-o 1x", "is not a valid Python variable name"),
    ("--colour red", "valid options: --checkpoint-every, --gpus"),
])
def test_bad_options_are_usage_errors_listing_choices(shell, line, needle):
    with pytest.raises(UsageError, match=None) as err:
        shell.run_cell_magic("singularity", line, "1")
    assert needle in str(err.value)


def test_other_mistakes_are_usage_errors(shell, jcluster):
    with pytest.raises(UsageError, match="choose from 'jobs', 'attach'"):
        shell.run_line_magic("singularity", "jbos")
    with pytest.raises(UsageError, match="not plain Python.*!cmd"):
        shell.run_cell_magic("singularity", "", "!ls\nx = 1")
    with pytest.raises(UsageError, match="no job 'j-nope'"):
        shell.run_line_magic("singularity", "attach j-nope")
    with pytest.raises(UsageError, match="choose from 'auto', 'on', 'off'"):
        shell.run_line_magic("singularity_config", "--widgets maybe")
    shell.user_ns["lock"] = threading.Lock()
    with pytest.raises(UsageError, match=r"cannot be sent with the job: lock \(lock"):
        shell.run_cell_magic("singularity", "", "with lock:\n    pass")
    with pytest.raises(UsageError, match="ranks"):  # the server's own rule, shown as is
        shell.run_cell_magic("singularity", "--gpus 2 --ranks 3", "1")


def test_ctrl_c_with_on_interrupt_cancel_cancels(shell, jclient, capsys):
    before = magics(shell).last_job
    stop = threading.Event()

    def interrupt_once_it_prints() -> None:
        """Ctrl-C while the cell follows its running job (a fixed delay could land before it
        waits, on a loaded machine, where nothing is there to act on it)."""
        while not stop.is_set():
            job = magics(shell).last_job
            if job is not None and job is not before and \
                    any(e.type.value == "log" for e in job.events(follow=False)):
                os.kill(os.getpid(), signal.SIGINT)
                return
            stop.wait(0.1)

    watcher = threading.Thread(target=interrupt_once_it_prints, daemon=True)
    watcher.start()
    try:
        assert shell.run_cell_magic("singularity", "--name interrupted --on-interrupt cancel", LONG_LOOP) is None
    finally:
        stop.set()
        watcher.join(10)
    job = magics(shell).last_job
    assert job.wait(30) == JobState.CANCELLED
    assert "Ctrl-C: cancel requested" in capsys.readouterr().out


def test_widget_follows_preempt_within_a_second(shell):
    shell.run_line_magic("singularity_config", "--widgets on")
    job = shell.run_cell_magic("singularity", "--no-wait --name widget", LONG_LOOP)
    w = magics(shell).widgets[job.id]
    follower = w.follower
    wait_until(lambda: w.view.log_lines > 0, what="the job's first output in the widget")
    assert ">running<" in w.header.value and "node-" in w.placement.value and not w.buttons["preempt"].disabled
    w.buttons["preempt"].click()
    # Live, not at the end: the job runs for minutes, so seeing "preempting" at all while it runs
    # proves the widget follows the stream (typically within 0.1 s; the bound is for loaded CI).
    # (The badge may already have moved on to "preempted": a checkpoint takes milliseconds.)
    wait_until(lambda: (">preempting<" in w.header.value or ">preempted<" in w.header.value)
               and ">preempting</td>" in w.timeline.value,
               timeout=10, what="preempting in the badge and the timeline")
    try:
        wait_until(lambda: ">preempted<" in w.header.value, timeout=30, what="preempted")
        assert ">preempted</td>" in w.timeline.value and not w.buttons["resume"].disabled
        w.buttons["resume"].click()
        wait_until(lambda: ">resumed</td>" in w.timeline.value, timeout=30, what="resumed")
        assert ">running<" in w.header.value
    finally:
        w.buttons["cancel"].click()
    wait_until(lambda: ">cancelled<" in w.header.value, timeout=30, what="cancelled")
    assert all(b.disabled for b in w.buttons.values())
    follower.join(5)
    assert not follower.alive, "the follower thread must stop when the job ends"


def test_migrate_and_resize_buttons_answer_gracefully(shell):
    shell.run_line_magic("singularity_config", "--widgets on")
    job = shell.run_cell_magic("singularity", "--no-wait --name controls", LONG_LOOP)
    w = magics(shell).widgets[job.id]
    try:
        wait_until(lambda: w.view.state == JobState.RUNNING, what="running")
        node = job.refresh().placement[0].node
        # a one-rank job cannot spread over two devices: the server's reason, in one sentence
        w.resize_to.value = 2
        w.buttons["resize"].click()
        assert ">resize refused: " in w.message.value and "has 1 rank(s)" in w.message.value, w.message.value
        assert job.refresh().state == JobState.RUNNING
        w.buttons["migrate"].click()
        assert ">migration requested<" in w.message.value, w.message.value
        wait_until(lambda: (i := job.refresh()).state == JobState.RUNNING and i.placement[0].node != node,
                   timeout=60, what="the job to run on another node")
    finally:
        cancel_quietly(job)


def test_jobs_attach_wait_and_logs(shell, jclient, capsys):
    shell.run_cell_magic("singularity", "--no-wait --name later -o later_job",
                         "import time\ntime.sleep(0.5)\nprint('late line')\nanswer = 41 + 1\nanswer * 2")
    shell.user_ns.pop("answer", None)
    shell.run_line_magic("singularity", "jobs")
    assert "later" in capsys.readouterr().out
    assert shell.run_line_magic("singularity", "attach later_job --wait") == 84
    assert shell.user_ns["answer"] == 42
    shell.run_line_magic("singularity", "logs later_job")
    assert "late line" in capsys.readouterr().out
    with pytest.raises(UsageError, match="only a running job can be"):
        shell.run_line_magic("singularity", "preempt later_job")


def test_cluster_widget_shows_devices_live(shell, jclient, capsys):
    from jupyter_ext.cluster_widget import ClusterWidget

    shell.run_line_magic("singularity", "cluster")  # text mode in a plain shell
    assert "node-1" in capsys.readouterr().out
    w = ClusterWidget(jclient, poll_s=5.0).start()
    try:
        wait_until(lambda: "node-2" in w.grid.value, what="both nodes in the grid")
        job = jclient.submit(LONG_LOOP, name="holder")
        took = wait_until(lambda: job.id in w.grid.value, timeout=10, what="the job on its device")
        assert took < 3.0 and "holder" in w.grid.value
        job.cancel()
        wait_until(lambda: job.id not in w.grid.value, timeout=10, what="the device freed")
    finally:
        w.close()
    wait_until(lambda: not w.alive, timeout=8, what="the cluster thread to stop")


DDP_CELL = (Path(__file__).resolve().parents[1] / "e2e" / "programs" / "ddp_train.py").read_text().replace(
    'int(os.environ.get("STEPS", "60"))', "150")


def test_a_data_parallel_cell_resized_from_its_widget_stays_exact(shell):
    """`%%singularity --gpus 2 --ranks 2` on an ordinary DDP cell; the widget's Resize button
    moves it to one device (both ranks share it) and back; the cell's value and every rank's
    losses equal those of a cell that was never resized."""
    shell.run_line_magic("singularity_config", "--widgets on")
    plain = shell.run_cell_magic("singularity", "--gpus 2 --ranks 2 --name ddp-plain -o ddp_plain_job", DDP_CELL)
    reference = shell.user_ns["ddp_plain_job"].logs()
    job = shell.run_cell_magic("singularity", "--gpus 2 --ranks 2 --no-wait --name ddp-widget", DDP_CELL)
    w = magics(shell).widgets[job.id]
    try:
        wait_until(lambda: w.view.log_lines > 20, timeout=120, what="training")
        for done, size in enumerate((1, 2), start=1):
            w.resize_to.value = size
            w.buttons["resize"].click()
            assert "resize to" in w.message.value, w.message.value
            wait_until(lambda: sum(e.type.value == "resized" for e in job.events(follow=False)) == done,
                       timeout=120, interval=0.2, what=f"resized to {size} device(s)")
            wait_until(lambda: sum(len(p["devices"]) for p in w.view.placement) == size, what="the widget's placement")
            assert ("splicing x2" in w.view.placement_text()) == (size == 1)
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    finally:
        cancel_quietly(job)
    assert job.result() == plain
    assert sorted(job.logs().splitlines()) == sorted(reference.splitlines())
