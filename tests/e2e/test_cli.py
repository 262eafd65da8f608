"""``singularityctl`` against a real cluster, found through SINGULARITY_HOME/server.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path



def ctl(cluster, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "SINGULARITY_HOME": str(cluster.home)}
    env.pop("SINGULARITY_URL", None)
    env.pop("SINGULARITY_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "singularity_sdk.cli", *args], env=env, input=input,
                          capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"singularityctl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_submit_events_jobs_logs_show(cluster, tmp_path):
    script = tmp_path / "count.py"
    script.write_text("for i in range(3):\n    print('n', i)\n")
    job_id = ctl(cluster, "submit", str(script), "--gpus", "1", "--sla", "basic", "--name", "count").stdout.strip()
    assert job_id.startswith("j-")
    events = ctl(cluster, "events", job_id, "-f").stdout
    for word in ("submitted", "scheduled", "started", "log", "succeeded"):
        assert word in events
    assert "node-" in events
    logs = ctl(cluster, "logs", job_id).stdout
    assert logs == "n 0\nn 1\nn 2\n"
    table = ctl(cluster, "jobs").stdout
    header = table.splitlines()[0].split()
    assert header == ["ID", "NAME", "STATE", "SLA", "DEVICES", "NODE", "AGE"]
    assert job_id in table and "count" in table and "basic" in table
    listed = json.loads(ctl(cluster, "jobs", "--json").stdout)
    assert any(j["id"] == job_id and j["state"] == "succeeded" for j in listed)
    shown = json.loads(ctl(cluster, "show", job_id, "--json").stdout)
    assert shown["name"] == "count" and shown["sla"] == "basic"
    nodes = json.loads(ctl(cluster, "nodes", "--json").stdout)
    assert [n["name"] for n in nodes] == ["node-1", "node-2"]
    assert "node-1" in ctl(cluster, "nodes").stdout


def test_submit_stdin_json_wait_and_failure_exit_code(cluster):
    out = ctl(cluster, "submit", "-", "--json", input="print('from stdin')\n")
    assert json.loads(out.stdout)["id"].startswith("j-")
    bad = ctl(cluster, "submit", "-", "--wait", input="raise RuntimeError('nope')\n", check=False)
    assert bad.returncode == 1
    assert "RuntimeError: nope" in bad.stderr


def test_cancel_and_clear_errors(cluster):
    job_id = ctl(cluster, "submit", "-", input="import time\ntime.sleep(60)\n").stdout.strip()
    assert ctl(cluster, "cancel", job_id).stdout.strip() == f"{job_id}: cancelled"
    missing = ctl(cluster, "show", "j-ffffff", check=False)
    assert missing.returncode == 2 and "no job 'j-ffffff'" in missing.stderr
    too_big = ctl(cluster, "submit", "-", "--gpus", "9", input="1\n", check=False)
    assert too_big.returncode == 2 and "ask for at most 4" in too_big.stderr
    bad_sla = ctl(cluster, "submit", "-", "--sla", "gold", input="1\n", check=False)
    assert bad_sla.returncode == 2 and "premium" in bad_sla.stderr


def test_no_server_configured(tmp_path):
    env = {**os.environ, "SINGULARITY_HOME": str(tmp_path)}
    env.pop("SINGULARITY_URL", None)
    proc = subprocess.run([sys.executable, "-m", "singularity_sdk.cli", "jobs"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "singularityctl serve" in proc.stderr


def test_resize_a_two_rank_job_from_the_shell(cluster, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text((Path(__file__).parent / "programs" / "ddp_train.py").read_text())
    job_id = ctl(cluster, "submit", str(script), "--gpus", "2", "--ranks", "2", "--env", "STEPS=5000").stdout.strip()
    bad = ctl(cluster, "resize", job_id, "--gpus", "3", check=False)
    assert bad.returncode != 0 and "1, 2 device(s), not 3" in bad.stderr
    deadline = time.monotonic() + 120
    while "step 3 loss" not in ctl(cluster, "logs", job_id).stdout:  # until it trains
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.3)
    done = ctl(cluster, "resize", job_id, "--gpus", "1").stdout
    assert f"{job_id}: running (resized 2 -> 1 devices (2 rank(s) per device)" in done
    ctl(cluster, "cancel", job_id)
    logs = ctl(cluster, "logs", job_id).stdout
    assert logs.startswith("[rank ") and "[rank 1] step 0 loss" in logs


def test_a_reader_that_leaves_early_is_not_an_error(cluster):
    """``singularityctl show j-1 | head -3``: the pipe closes under the CLI; it ends quietly."""
    env = {**os.environ, "SINGULARITY_HOME": str(cluster.home)}
    env.pop("SINGULARITY_URL", None)
    env.pop("SINGULARITY_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "singularity_sdk.cli", "nodes"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before it prints anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
