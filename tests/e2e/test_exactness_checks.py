"""What exactness depends on is checked: a checkpoint records python/torch/numpy versions and
the device model; a job with a checkpoint is resumed (or migrated) only onto nodes that match,
and when none can, the restore is refused naming the difference.

One node here is a real agent started with ``SINGULARITY_FINGERPRINT_OVERRIDE`` (the documented
test/ops knob) so that it reports another torch version, as a node with another install would."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from exactness import source, stdout_lines, wait_for_lines
from singularity_sdk import EventType, JobState, LocalCluster
from singularity_sdk.errors import Conflict

ODD_TORCH = "0.0.1-other-build"


def _start_odd_agent(cluster: LocalCluster) -> subprocess.Popen:
    env = {**os.environ, "SINGULARITY_HOME": str(cluster.home), "SINGULARITY_JOIN_TOKEN": cluster.agent_token,
           "SINGULARITY_FINGERPRINT_OVERRIDE": json.dumps({"torch": ODD_TORCH})}
    log = open(cluster.home / "logs" / "agent-odd.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "backend.agent", "--server", cluster.url,
                             "--name", "odd", "--devices", "1",
                             "--home", str(cluster.home / "agents" / "odd"),
                             "--checkpoint-root", str(cluster.home / "checkpoints"), "--orphan-timeout", "60"],
                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    with cluster.client() as c:
        deadline = time.monotonic() + 60
        while not any(n.name == "odd" and n.state.value == "ready" for n in c.nodes()):
            assert proc.poll() is None and time.monotonic() < deadline, "the odd agent did not register"
            time.sleep(0.1)
    return proc


@pytest.fixture()
def three_nodes(tmp_path):
    """node-1 and node-2 as installed, and 'odd', whose agent reports another torch version."""
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", node_timeout=2.0) as cluster:
        odd = _start_odd_agent(cluster)
        try:
            yield cluster, odd
        finally:
            if odd.poll() is None:
                os.killpg(odd.pid, signal.SIGKILL)
                odd.wait()


def _node(job) -> str:
    return job.refresh().placement[0].node


def _wait_state(job, state, timeout=60.0):
    deadline = time.monotonic() + timeout
    while job.refresh().state != state:
        assert time.monotonic() < deadline, f"job is {job.state}, not {state}"
        time.sleep(0.1)


def test_a_checkpoint_resumes_only_where_it_resumes_exactly(three_nodes):
    cluster, _odd = three_nodes
    code = source("torch_steps.py")
    with cluster.client() as client:
        plain = client.submit(code, env={"STEPS": "400", "STEP_SLEEP": "0"}, name="plain")
        assert plain.wait(120) == JobState.SUCCEEDED, plain.info.error
        # The job and a blocker fill node-1 and node-2 (odd is drained meanwhile), so the only
        # free device left is the odd node's.
        client.drain("odd")
        job = client.submit(code, env={"STEPS": "400"}, name="train")
        blocker = client.submit("import time\nfor i in range(600):\n    time.sleep(0.1)\n", name="blocker")
        wait_for_lines(job, 3)
        _wait_state(blocker, JobState.RUNNING)
        client.undrain("odd")
        assert {_node(job), _node(blocker)} == {"node-1", "node-2"}

        job.checkpoint(timeout=60)
        recorded = [e for e in job.events(follow=False) if e.type == EventType.CHECKPOINTED][-1].data["fingerprint"]
        import torch
        assert recorded["torch"] == torch.__version__ and recorded["device"] == "cpu"

        # Migrating onto the odd node is refused, naming the difference; so is "anywhere".
        with pytest.raises(Conflict, match=re.escape(f"torch {torch.__version__} (checkpoint) vs {ODD_TORCH} (odd)")):
            job.migrate("odd")
        with pytest.raises(Conflict, match="resumes exactly"):
            job.migrate()
        assert job.refresh().state == JobState.RUNNING

        # Preempted, its node taken by another job, and resumed: it waits for a matching node
        # although 'odd' is free.
        job.preempt(timeout=60)
        client.drain("odd")
        blocker2 = client.submit("import time\nfor i in range(600):\n    time.sleep(0.1)\n", name="blocker-2")
        _wait_state(blocker2, JobState.RUNNING)
        client.undrain("odd")
        job.resume()
        time.sleep(3)  # several scheduling rounds
        assert job.refresh().state == JobState.QUEUED, [(e.type.value, e.data) for e in job.events(follow=False)
                                                         if e.type in (EventType.SCHEDULED, EventType.PREEMPTED, EventType.CHECKPOINTED)][-4:]
        blocker.cancel()
        blocker2.cancel()
        assert job.wait(120) == JobState.SUCCEEDED, job.info.error
        assert all(e.data["placement"][0]["node"] != "odd"
                   for e in job.events(follow=False) if e.type == EventType.SCHEDULED)
        assert stdout_lines(job) == stdout_lines(plain) and job.result() == plain.result()


def test_a_restore_nothing_matches_is_refused_naming_the_difference(three_nodes):
    cluster, odd = three_nodes
    code = source("torch_steps.py")
    with cluster.client() as client:
        client.drain("node-1")
        client.drain("node-2")
        job = client.submit(code, env={"STEPS": "200"}, name="on-odd")
        wait_for_lines(job, 3)
        assert _node(job) == "odd"
        job.preempt(timeout=60)
        client.undrain("node-1")
        client.undrain("node-2")
        # The only node that could resume it goes away for good.
        os.killpg(odd.pid, signal.SIGKILL)
        odd.wait()
        deadline = time.monotonic() + 30
        while next(n for n in client.nodes() if n.name == "odd").state.value != "lost":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        job.resume()
        assert job.wait(120) == JobState.FAILED
        import torch
        assert f"torch {ODD_TORCH} (checkpoint) vs {torch.__version__} (here)" in job.info.error
        assert "cannot resume exactly here" in job.info.error
