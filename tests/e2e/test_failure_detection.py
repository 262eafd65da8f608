"""A node whose agent's process dies is lost as soon as its connection drops (no close frame)
and it does not come back, not after the heartbeat timeout: its jobs resume elsewhere."""
from __future__ import annotations

import os
import signal
import time

from singularity_sdk import EventType, JobState, LocalCluster

SLEEPER = "import time\nfor i in range(100000):\n    time.sleep(0.05)\n"


def test_a_dead_agents_jobs_move_on_without_waiting_for_the_heartbeat_timeout(tmp_path):
    # node_timeout is far longer than the test waits: only the dropped connection can explain a move
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "home", node_timeout=600) as cluster, \
            cluster.client() as c:
        job = c.submit(SLEEPER)
        while job.refresh().state != JobState.RUNNING:
            time.sleep(0.05)
        node = job.info.placement[0].node
        os.killpg(cluster.agent_pids()[node], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (job.refresh().state == JobState.RUNNING and job.info.placement[0].node != node):
            assert time.monotonic() < deadline, f"{job.id} did not move off {node}"
            time.sleep(0.1)
        lost = [e for e in job.events(follow=False) if e.type == EventType.NODE_LOST]
        assert lost and lost[0].data["node"] == node and "connection dropped" in lost[0].data["why"]
        assert {n.name: n.state.value for n in c.nodes()}[node] == "lost"
        job.cancel()
