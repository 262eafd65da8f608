"""Checkpoints written behind the loop: the loop runs on during the write, at most one write is in
flight, a preemption waits for it, and a kill -9 mid-write leaves the previous checkpoint."""
from __future__ import annotations

import os
import signal
import time

from harness import EXIT_PREEMPTED

SLEEP_HOOK = "SINGULARITY_PROXY_TEST_SLEEP_IN_WRITE"

# A paced loop whose state holds tensors, printing each iteration; 60 x 20 ms.
PACED = """
import time
import torch
torch.manual_seed(0)
w = torch.randn(64, 64)
for i in range(60):
    w = torch.tanh(w @ w.T / 64 + torch.randn(64, 64) * 0.01)
    print(i, w.sum().item().hex(), flush=True)
    time.sleep(0.02)
"""


def _script(tmp_path):
    script = tmp_path / "paced.py"
    script.write_text(PACED)
    return [str(script)]


def _plain_output(tmp_path) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(PACED.replace("time.sleep(0.02)", "pass"), "<plain>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_the_loop_runs_on_while_a_periodic_checkpoint_is_written(launcher, tmp_path):
    target = _script(tmp_path)
    # every write sleeps 0.3 s half-way: written in line, no iteration could run meanwhile
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0.1",
                                 "--keep-checkpoints"], env={SLEEP_HOOK: "0.3"})
    assert run.rc == 0, run.describe()
    assert run.stdout == _plain_output(tmp_path)
    done = [d for _, d in run.events("checkpointed")]
    started = [d for _, d in run.events("checkpoint_started")]
    assert len(done) >= 2 and all(d["background"] for d in done)
    assert all(d["snapshot_s"] < d["seconds"] for d in done), "the loop was held only for the snapshot"
    # checkpoints are numbered by their safe point: the loop moved on between consecutive ones
    # even though each write took the 0.3 s the hook sleeps, i.e. the loop ran during the writes
    steps = [d["step"] for d in started]
    assert steps == sorted(set(steps))
    assert sorted(p.name for p in (tmp_path / "ck").glob("ckpt-*"))[-1] == f"ckpt-{done[-1]['step']:08d}"


def test_a_preemption_waits_for_the_write_in_flight_and_resumes_exactly(launcher, tmp_path):
    target = _script(tmp_path)
    ck = tmp_path / "ck"
    handle = launcher.start(target + ["--checkpoint-dir", str(ck), "--checkpoint-every", "0.1",
                                      "--stop-after-seconds", "0.6"], env={SLEEP_HOOK: "0.4"})
    stopped = handle.wait(120)
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    events = [(k, d) for k, d in stopped.events() if k in ("checkpoint_started", "checkpointed", "stopped")]
    # every checkpoint that started committed, in order, the preemption's last, before it stopped
    started = [d["step"] for k, d in events if k == "checkpoint_started"]
    committed = [d["step"] for k, d in events if k == "checkpointed"]
    assert len(started) >= 2 and committed == started and events[-2][0] == "checkpointed"
    assert events[-1][0] == "stopped" and events[-1][1]["step"] == started[-1]
    final = events[-2][1]
    assert "background" not in final, "the preemption's own checkpoint is written in line"
    resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
    assert resumed.rc == 0, resumed.describe()
    assert stopped.stdout + resumed.stdout == _plain_output(tmp_path)


def test_kill_during_a_background_write_keeps_the_previous_checkpoint(launcher, tmp_path):
    target = _script(tmp_path)
    ck = tmp_path / "ck"
    handle = launcher.start(target + ["--checkpoint-dir", str(ck), "--checkpoint-every", "0.05",
                                      "--keep-checkpoints"], env={SLEEP_HOOK: "30"})
    deadline = time.monotonic() + 60
    while "test hook: sleeping" not in handle.stderr_so_far():  # the first write is mid-way
        assert time.monotonic() < deadline, handle.stderr_so_far()
        time.sleep(0.02)
    os.kill(handle.pid, signal.SIGKILL)
    killed = handle.wait()
    assert killed.rc == -signal.SIGKILL
    assert not list(ck.glob("ckpt-*")), "the write in flight never commits"
    rerun = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore", "--checkpoint-every", "0.05",
                                   "--keep-checkpoints"])
    assert rerun.rc == 0, rerun.describe()
    assert rerun.stdout == _plain_output(tmp_path), "no checkpoint: it started over, and exactly"
    written = [d for _, d in rerun.events("checkpointed")]
    again = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
    assert again.rc == 0 and written, again.describe()
    assert [d["step"] for _, d in again.events("restore")] == [written[-1]["step"]]
    assert rerun.stdout.endswith(again.stdout), "resumed from its newest background checkpoint"


# A checkpoint is taken before `import torch`; its write (slowed by the hook) commits while the
# program is half-way through that import, when torch is in sys.modules but not yet usable.
LATE_IMPORT = """
import time
for i in range(15):
    time.sleep(0.02)
import torch
print(torch.ones(3).sum().item(), flush=True)
"""


def test_a_write_behind_that_ends_during_an_import_reports_what_the_safe_point_depended_on(fresh_launcher, tmp_path):
    """A fresh interpreter (the warm launcher has imported torch already). The report used to be
    made when the write committed, on the writer's thread, where reading the half-imported torch
    raised: the event was lost and a traceback went into the job's output."""
    script = tmp_path / "late_import.py"
    script.write_text(LATE_IMPORT)
    run = fresh_launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "0.1"],
                       env={SLEEP_HOOK: "0.5"})
    assert run.rc == 0, run.describe()
    assert run.stdout == "3.0\n"
    assert "raised" not in run.stderr and "Traceback" not in run.stderr, run.describe()
    done = [d for _, d in run.events("checkpointed")]
    assert done and all(d["background"] for d in done)
    # taken at the safe point, on the program's thread: torch was not imported yet
    assert done[0]["fingerprint"]["torch"] is None and done[0]["fingerprint"]["python"]
