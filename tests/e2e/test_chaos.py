"""Chaos (issue 13): ``kill -9`` of a worker, of a node agent or of the server, at a seeded random
moment of a running job with periodic checkpoints. Every trial checks that the job succeeds, that
nothing is lost (its result and its log equal an uninterrupted run's, so the lines a dead attempt
printed after its last checkpoint were superseded) and that nothing ran twice at once (no two
attempts' workers alive at the same moment, watched through the job's ``started`` events and
/proc while it runs)."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from exactness import source, wait_for_lines
from processes import pid_alive
from singularity_sdk import EventType, JobState, LocalCluster

PROGRAM = source("steady_rng.py")
STEPS = 100  # ~5 s
ENV = {"STEPS": str(STEPS)}
#: CHAOS_SEED=N runs other moments (and another order) than the suite's
SEED = int(os.environ.get("CHAOS_SEED", "3"))
KINDS = ("worker", "agent", "server")
#: the agents' lease (a LocalCluster's agents get its node timeout): a server down for longer has
#: the job checkpoint and stop, to resume when the server is back
LEASE_S = 3.0


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot): tells a pid from a later one reusing it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Overlap(threading.Thread):
    """Watches one job while it runs: each attempt's worker pids (from its ``started`` events)
    and whether they are alive (/proc); records every moment when workers of two attempts are."""

    def __init__(self, cluster: LocalCluster, job_id: str):
        super().__init__(daemon=True)
        self.cluster, self.job_id = cluster, job_id
        self.pids: dict[int, dict[int, Optional[str]]] = {}  # attempt -> pid -> start time when first seen
        self.overlaps: list[dict[int, list[int]]] = []
        self.finished = threading.Event()

    def _learn(self) -> None:
        try:
            with self.cluster.client() as c:
                events = list(c.get(self.job_id).events(follow=False))
        except Exception:  # the server is down for this trial: the pids known so far are watched
            return
        for e in events:
            if e.type == EventType.STARTED:
                attempt = int(e.data["attempt"])
                for pid in e.data["pids"].values():
                    self.pids.setdefault(attempt, {}).setdefault(int(pid), _start_time(int(pid)))

    def alive(self) -> dict[int, list[int]]:
        """attempt -> its workers alive now (a pid now held by another process does not count)."""
        out: dict[int, list[int]] = {}
        for attempt, pids in self.pids.items():
            for pid, started in pids.items():
                if started is not None and pid_alive(pid) and _start_time(pid) == started:
                    out.setdefault(attempt, []).append(pid)
        return out

    def run(self) -> None:
        while not self.finished.is_set():
            self._learn()
            alive = self.alive()
            if len(alive) > 1:
                self.overlaps.append(alive)
            self.finished.wait(0.1)
        self._learn()


def _story(job) -> list[str]:
    """The job's events, one short line each, but its log lines (for a failed trial's message)."""
    out = []
    for e in job.events(follow=False):
        if e.type == EventType.LOG:
            out += [f"{e.seq} log {line.split(' acc')[0]}" for line in e.lines]
        else:
            out.append(f"{e.seq} {e.type.value} {({k: v for k, v in e.data.items() if k not in ('pickle_b64', 'outputs_b64')})}")
    return out


def _kill(cluster: LocalCluster, job, kind: str, rng: random.Random) -> str:
    if kind == "worker":
        started = [e for e in job.events(follow=False) if e.type == EventType.STARTED][-1]
        os.kill(int(started.data["pids"]["0"]), signal.SIGKILL)
        return f"worker {started.data['pids']['0']}"
    if kind == "agent":
        node = job.refresh().placement[0].node
        os.kill(cluster.agent_pids()[node], signal.SIGKILL)  # the agent alone: its workers must follow it
        return f"agent of {node}"
    # with the ~1.5 s a server takes to start here, about half the time past the lease
    down = round(rng.uniform(0.0, LEASE_S), 2)
    cluster.kill_server()
    time.sleep(down)  # the job runs on meanwhile, its events wait in the agent's outbox
    cluster.restart_server()
    return f"server, down {down} s"


def test_kill9_of_worker_agent_or_server_loses_nothing_and_runs_nothing_twice(tmp_path):
    rng = random.Random(SEED)
    kinds = list(KINDS) * 2
    rng.shuffle(kinds)
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "home", node_timeout=LEASE_S) as cluster:
        with cluster.client() as c:
            plain = c.submit(PROGRAM, name="plain", env=ENV, checkpoint_every=0.5)
            assert plain.wait(120) == JobState.SUCCEEDED
            logs, value = plain.logs(), plain.result()
        assert logs.count("\n") == STEPS
        for trial, kind in enumerate(kinds):
            # a server is killed early enough that a downtime past the lease finds the job running
            lines = rng.randint(3, 20 if kind == "server" else STEPS - 30)  # >= 1.5 s left to kill in
            with cluster.client() as c:
                job = c.submit(PROGRAM, name=f"chaos-{trial}-{kind}", env=ENV, checkpoint_every=0.5)
                watch = Overlap(cluster, job.id)
                watch.start()
                wait_for_lines(job, lines)
                time.sleep(rng.uniform(0.0, 0.5))  # anywhere in a checkpoint interval, a checkpoint too
                what = _kill(cluster, job, kind, rng)
            with cluster.client() as c:
                job = c.get(job.id)
                state = job.wait(120)
                label = f"trial {trial}: kill -9 of the {what} after {lines} lines"
                assert state == JobState.SUCCEEDED, (label, job.info.error)
                deadline = time.monotonic() + 30
                while watch.alive() and time.monotonic() < deadline:  # a finished job leaves no worker
                    time.sleep(0.1)
                watch.finished.set()
                watch.join(30)
                assert not watch.alive(), (label, "workers outlived their job", watch.alive())
                assert not watch.overlaps, (label, "two attempts ran at once", watch.overlaps[:3])
                assert job.result() == value, label
                assert job.logs() == logs, (label, _story(job))
                if kind != "server":
                    assert job.refresh().info.attempt > 1, label
                evs = list(job.events(follow=False))
                print(label, "->", f"attempt {job.info.attempt}, superseded",
                      [e.data.get("lines") for e in evs if e.type == EventType.SUPERSEDED],
                      [e.data.get("reason") for e in evs if e.type == EventType.PREEMPTED])
            if kind == "agent":  # bring the node back for the next trials: a restarted server starts it
                cluster.kill_server()
                cluster.restart_server()
