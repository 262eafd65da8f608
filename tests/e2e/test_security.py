"""A hostile job, client or node cannot break the service (issue 13's "What failed", one test
each): jobs cannot read credentials or other jobs' files, a node speaks only for its own jobs,
a node's name cannot be taken over, bad input gets a clear 4xx, bad agent messages are skipped
with the connection kept, and the CLI's move commands end cleanly."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from backend.agent import sandbox
from processes import started_as, until_workers_fork
from singularity_sdk import JobState, LocalCluster

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = "import time\nfor i in range(100000):\n    time.sleep(0.05)\n"


def api(cluster: LocalCluster, token: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.url + "/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def enroll(cluster: LocalCluster, node: str) -> httpx.Response:
    with api(cluster, cluster.agent_token) as h:
        return h.post(f"/nodes/{node}/enroll", json={})


def agent_socket(cluster: LocalCluster, token: str) -> ClientConnection:
    return connect(cluster.url.replace("http", "ws") + "/api/v1/agents/ws",
                   additional_headers={"Authorization": f"Bearer {token}"}, max_size=2**26)


def hello(node: str, devices: int = 0) -> str:
    return json.dumps({"type": "hello", "node": node, "instance": f"spy-{time.monotonic_ns()}",
                       "devices": [{"index": i, "kind": "cpu", "name": f"cpu-slot-{i}"} for i in range(devices)]})


def recv_until(ws: ClientConnection, want: str, timeout: float = 30) -> dict[str, Any]:
    """The next message of type ``want`` (heartbeat answers and others are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if msg.get("type") == want:
            return msg


def events_msg(*events: dict[str, Any]) -> str:
    return json.dumps({"type": "events", "events": list(events)})


def wait_state(job, states: set[JobState], timeout: float = 60) -> JobState:
    deadline = time.monotonic() + timeout
    while job.refresh().state not in states:
        assert time.monotonic() < deadline, f"{job.id} stayed {job.state}"
        time.sleep(0.1)
    return job.state


@pytest.fixture(scope="module")
def two_nodes():
    with LocalCluster(nodes=2, devices_per_node=1) as c:
        yield c


# ---------------------------------------------------------------- 1: credentials and other jobs' files


SPY_JOB = r'''
import glob, json, os
home, tokens = HOME, TOKENS
found = {"read": [], "leaks": []}
me = os.environ["SINGULARITY_JOB_ID"]  # its own files hold its own code, tokens and all
def look(path):
    if me in path:
        return
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return
    found["read"].append(path)
    found["leaks"] += [path for t in tokens if t.encode() in data]
for name in ("server.json", "credentials.json", "state.db", "state.db-wal"):
    look(os.path.join(home, name))
for path in glob.glob(os.path.join(home, "**", "*"), recursive=True):
    if os.path.isfile(path):
        look(path)
walked = os.getcwd()
while walked != "/":  # as the original spy did: walk up from the working directory
    look(os.path.join(walked, "server.json"))
    walked = os.path.dirname(walked)
pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
for pid in pids + ["self"]:  # a fork's own environ is where it was forked from
    look(f"/proc/{pid}/environ")
    look(f"/proc/{pid}/cmdline")
found["env_leaks"] = [k for k, v in os.environ.items() if any(t in v for t in tokens)]
found["processes"] = len(pids)
with open("own-folder.txt", "w") as f:  # the folder it was submitted from stays its own
    f.write("written")
print("SPY " + json.dumps(found))
'''


@pytest.mark.skipif(sandbox.choose() is None, reason="no working bwrap here (make setup installs bubblewrap)")
@pytest.mark.parametrize("spawn", ["fresh+sandbox", "fork+sandbox"])
def test_a_job_reads_no_credential_and_no_other_jobs_files(tmp_path, spawn):
    if spawn == "fork+sandbox" and sandbox.forks_can_sandbox() is not None:
        pytest.skip(f"a fork cannot make its own sandbox here: {sandbox.forks_can_sandbox()}")
    with LocalCluster(nodes=1, devices_per_node=2, home=tmp_path / "home", sandbox="bwrap",
                      env={"SINGULARITY_TOKEN": "x" * 43,
                           "SINGULARITY_WARM_WORKERS": "1" if spawn.startswith("fork") else "0"},
                      ) as cluster, cluster.client() as admin:
        with api(cluster, cluster.token) as h:
            other_token = h.post("/users", json={"user": "alice"}).json()["token"]
        home = cluster.home
        node_token = (home / "agents" / "node-1" / "credential").read_text().strip()
        tokens = [cluster.token, cluster.agent_token, node_token, other_token, "x" * 43]
        with cluster.client(other_token) as alice:
            victim = alice.submit(SLEEPER, name="victim", env={"SECRET": "alice-secret"})
            wait_state(victim, {JobState.RUNNING})
        db = b"".join(p.read_bytes() for p in home.glob("state.db*"))  # before the spy's code (tokens) is in it
        assert not [t for t in tokens if t.encode() in db]
        if spawn.startswith("fork"):
            until_workers_fork(admin)
        folder = tmp_path / "mine"
        folder.mkdir()
        src = SPY_JOB.replace("HOME", repr(str(home))).replace("TOKENS", repr(tokens + ["alice-secret"]))
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            job = admin.submit(src, name="spy")
        finally:
            os.chdir(cwd)
        job.wait(120)
        assert started_as(job) == {"0": spawn}
        line = next(ln for ln in job.logs().splitlines() if ln.startswith("SPY "))
        found = json.loads(line[4:])
        assert found["leaks"] == [] and found["env_leaks"] == [], found
        assert not [p for p in found["read"] if p.startswith(str(home))], found["read"]
        assert found["processes"] <= 3, "the job sees other processes in /proc"
        assert (folder / "own-folder.txt").read_text() == "written"
        # The files themselves: owner-only, and the store holds no token in clear.
        assert home.stat().st_mode & 0o777 == 0o700
        for name in ("server.json", "credentials.json", "state.db", "agents/node-1/credential"):
            assert (home / name).stat().st_mode & 0o077 == 0, name
        assert b"alice-secret" not in (home / "agents" / "node-1" / "credential").read_bytes()
        pids = cluster.agent_pids()
        assert node_token.encode() not in Path(f"/proc/{pids['node-1']}/cmdline").read_bytes()


# ---------------------------------------------------------------- 2, 3: fencing and node names


def test_a_node_speaks_only_for_jobs_placed_on_it(two_nodes):
    with two_nodes.client() as c:
        job = c.submit(SLEEPER, name="victim")
        wait_state(job, {JobState.RUNNING})
        attempt = job.info.attempt
        r = enroll(two_nodes, "spy-node")
        assert r.status_code == 201, r.text
        with agent_socket(two_nodes, r.json()["token"]) as ws:
            ws.send(hello("spy-node"))
            recv_until(ws, "welcome")
            now = time.time()
            ws.send(events_msg(
                {"agent_seq": 1, "job_id": job.id, "attempt": attempt, "type": "log", "time": now,
                 "data": {"rank": 0, "stream": "stdout", "line": "INJECTED\n"}},
                {"agent_seq": 2, "job_id": job.id, "attempt": attempt, "type": "worker_exited", "time": now,
                 "data": {"rank": 0, "code": 0}}))
            errors = [recv_until(ws, "error")["error"] for _ in range(2)]
            assert all("not placed on spy-node" in e for e in errors), errors
            assert recv_until(ws, "ack")["agent_seq"] == 2
        time.sleep(1.0)
        assert job.refresh().state == JobState.RUNNING
        assert "INJECTED" not in job.logs()
        assert not [e for e in job.events(follow=False) if e.type.value == "worker_exited"]
        server_log = (two_nodes.home / "server.log").read_text()
        assert "from node spy-node refused" in server_log
        job.cancel()
        wait_state(job, {JobState.CANCELLED})


def test_a_hello_reusing_a_live_nodes_name_takes_nothing_over(two_nodes):
    with two_nodes.client() as c:
        job = c.submit(SLEEPER, name="stays")
        wait_state(job, {JobState.RUNNING})
        node = job.info.placement[0].node
        assert enroll(two_nodes, node).status_code == 409, "the join token must not re-enroll a live node"
        r = enroll(two_nodes, "other-node")
        with agent_socket(two_nodes, r.json()["token"]) as ws:
            ws.send(hello(node, devices=4))
            assert f"belongs to node 'other-node', not '{node}'" in recv_until(ws, "error")["error"]
            ws.send(events_msg({"agent_seq": 1, "job_id": job.id, "attempt": job.info.attempt, "type": "log",
                                "time": time.time(), "data": {"rank": 0, "stream": "stdout", "line": "x\n"}}))
            assert "send 'hello' first" in recv_until(ws, "error")["error"]
        time.sleep(1.0)
        assert job.refresh().state == JobState.RUNNING and job.info.placement[0].node == node
        shape = {n.name: (n.state.value, len(n.devices)) for n in c.nodes()}
        assert shape[node] == ("ready", 1)
        job.cancel()
        wait_state(job, {JobState.CANCELLED})


def test_node_and_join_credentials_open_no_user_api(two_nodes):
    node_token = (two_nodes.home / "agents" / "node-1" / "credential").read_text().strip()
    for token in (node_token, two_nodes.agent_token):
        with api(two_nodes, token) as h:
            assert h.get("/jobs").status_code == 403
            assert h.post("/jobs", json={"source": "1"}).status_code == 403
        with pytest.raises(InvalidStatus) as info:
            connect(two_nodes.url.replace("http", "ws") + "/api/v1/events/ws",
                    additional_headers={"Authorization": f"Bearer {token}"})
        assert info.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as info:  # the join token does not open the agent channel
        agent_socket(two_nodes, two_nodes.agent_token)
    assert info.value.response.status_code == 403


def test_users_see_no_one_elses_job_ids_and_tokens_stay_out_of_the_log(two_nodes):
    with api(two_nodes, two_nodes.token) as h:
        bob = h.post("/users", json={"user": "bob"}).json()["token"]
    with two_nodes.client() as c:
        job = c.submit(SLEEPER, name="admins")
        wait_state(job, {JobState.RUNNING})
        with api(two_nodes, bob) as h:
            used = [v for n in h.get("/nodes").json() for v in n["used"].values()]
            assert job.id not in used and "(other)" in used
        used = [v for n in c.nodes() for v in n.used.values()]
        assert job.id in used  # the admin sees every job
        r = httpx.get(two_nodes.url + f"/api/v1/jobs?token={bob}")
        assert r.status_code == 200
        time.sleep(0.3)
        assert bob not in (two_nodes.home / "server.log").read_text()
        job.cancel()
        wait_state(job, {JobState.CANCELLED})


# ---------------------------------------------------------------- 4, 5, 7: validation at the edge


def test_output_names_env_names_and_rank_counts_are_checked_at_submit(two_nodes):
    with api(two_nodes, two_nodes.token) as h:
        r = h.post("/jobs", json={"source": "x=1", "outputs": ["../../etc/passwd"]})
        assert r.status_code == 422 and r.json()["field"] == "outputs" and "variable name" in r.json()["error"]
        r = h.post("/jobs", json={"source": "x=1", "env": {"A=B": "1"}})
        assert r.status_code == 422 and r.json()["field"] == "env"
        r = h.post("/jobs", json={"source": "x=1", "env": {"A": "1\x00"}})
        assert r.status_code == 422 and "NUL" in r.json()["error"]
        r = h.post("/jobs", json={"source": "x=1", "ranks": 4096})
        assert r.status_code == 422 and r.json()["field"] == "ranks"
        r = h.post("/jobs", json={"source": "x=1", "filename": "a\x00b.py"})
        assert r.status_code == 422 and r.json()["field"] == "filename"
        assert [j for j in h.get("/jobs").json() if j["state"] not in ("cancelled", "succeeded")] == []


def test_no_request_gets_a_500_or_internal_text(two_nodes):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    nested = json.dumps({"reason": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})
    with two_nodes.client() as c:
        job = c.submit("x = 1")
        job.wait(60)
    with api(two_nodes, two_nodes.token) as h:
        for path in ("/jobs", f"/jobs/{job.id}/cancel", f"/jobs/{job.id}/preempt", f"/jobs/{job.id}/resize",
                     "/nodes/node-1/drain", "/users", "/nodes/x/enroll"):
            for body in (deep, b'{"a":' * 5000 + b"1" + b"}" * 5000, nested.encode()):
                r = h.post(path, content=body)
                assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
                assert "internal" not in r.text and "Recursion" not in r.text
        r = h.get(f"/jobs/{job.id}/events", params={"since": str(10**30)})
        assert r.status_code == 422 and r.json()["field"] == "since"
    with pytest.raises(InvalidStatus) as info:
        connect(two_nodes.url.replace("http", "ws") + f"/api/v1/jobs/{job.id}/events/ws?since={10**30}",
                additional_headers={"Authorization": f"Bearer {two_nodes.token}"})
    assert info.value.response.status_code == 422
    with two_nodes.client() as c:
        assert c.health()["ok"]


def test_a_start_the_node_refuses_fails_the_job_at_once(tmp_path):
    """A node that must sandbox jobs and cannot (no bwrap on its PATH) refuses every start: the
    job fails with the reason instead of holding its device while its retries burn."""
    env = {"SINGULARITY_SANDBOX": "bwrap", "PATH": str(tmp_path / "empty")}
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "home", env=env) as cluster, \
            cluster.client() as c:
        job = c.submit("x = 1")
        assert job.wait(60) == JobState.FAILED
        assert "SINGULARITY_SANDBOX=bwrap" in job.info.error
        assert not [e for e in job.events(follow=False) if e.type.value == "retrying"]
        assert c.nodes()[0].used == {}


# ---------------------------------------------------------------- 6: malformed agent messages


@contextlib.contextmanager
def scripted_node(tmp_path: Path) -> Iterator[tuple[Any, ClientConnection, Any, dict[str, Any]]]:
    """A cluster whose only node is this test's socket, with one job started on it: (client,
    socket, job, its start message). The job's events then pass the fence, so what a test sees
    is what the server does with what the node says about a job it really holds."""
    with LocalCluster(nodes=0, home=tmp_path / "home") as cluster, cluster.client() as c:
        token = enroll(cluster, "scripted").json()["token"]
        with agent_socket(cluster, token) as ws:
            ws.send(hello("scripted", devices=1))
            recv_until(ws, "welcome")
            job = c.submit("x = 1")
            yield c, ws, job, recv_until(ws, "start")


def test_bad_agent_messages_are_answered_and_skipped_and_the_connection_stays(tmp_path):
    with scripted_node(tmp_path) as (c, ws, job, start):
        jid, attempt, now = start["job_id"], start["attempt"], time.time()
        ev = {"job_id": jid, "attempt": attempt, "time": now}
        bad = [
            events_msg({**ev, "agent_seq": 1, "type": "worker_exited", "data": {"rank": "abc", "code": 0}}),
            events_msg({**ev, "agent_seq": 2, "type": "log", "time": float("nan"), "data": {}}),
            events_msg({**ev, "agent_seq": 2**63, "type": "log", "data": {}}),
            '{"type": "events", "events": ' + "[" * 5000 + "]" * 5000 + "}",
            "not json",
        ]
        for msg in bad:
            ws.send(msg)
            assert recv_until(ws, "error")["error"]
        ws.send(events_msg({**ev, "agent_seq": 4, "type": "log",
                            "data": {"rank": 0, "stream": "stdout", "line": "fi\x00ne\n"}},
                           {**ev, "agent_seq": 5, "type": "worker_exited", "data": {"rank": 0, "code": 0}}))
        assert recv_until(ws, "ack")["agent_seq"] == 5
        assert job.wait(30) == JobState.SUCCEEDED
        assert job.logs() == "fi\x00ne\n"  # a program may print any character
        ws.send(events_msg({**ev, "agent_seq": 1, "type": "worker_exited", "data": {"rank": "abc"}}))
        assert recv_until(ws, "ack")["agent_seq"] == 5  # a replay of the skipped batch: nothing fails
        assert c.health()["ok"]


def test_a_batch_of_lines_is_appended_in_order_and_fenced_line_by_line(tmp_path):
    """Runs of log lines in one agent message are appended together (bench/load.py): the
    job's events keep the message's order around other events, a replayed part is skipped,
    and lines about a job not placed on the node are refused one by one."""
    with scripted_node(tmp_path) as (c, ws, job, start):
        queued = c.submit("y = 2")  # no device left for it: placed nowhere
        ev = {"job_id": start["job_id"], "attempt": start["attempt"], "time": time.time()}
        other = {**ev, "job_id": queued.id, "attempt": 0}
        line = lambda seq, text, e=ev: {**e, "agent_seq": seq, "type": "log",
                                         "data": {"rank": 0, "stream": "stdout", "line": text}}
        ws.send(events_msg(line(1, "a\n"), line(2, "b\n"), line(3, "c\n"),
                           {**ev, "agent_seq": 4, "type": "progress", "data": {"rank": 0, "step": 1}},
                           line(5, "d\n"), line(6, "spy\n", other), line(7, "spy\n", other), line(8, "e\n")))
        assert recv_until(ws, "ack")["agent_seq"] == 8
        ws.send(events_msg(line(7, "replayed\n"), line(8, "replayed\n"), line(9, "f\n"),
                           {**ev, "agent_seq": 10, "type": "worker_exited", "data": {"rank": 0, "code": 0}}))
        assert recv_until(ws, "ack")["agent_seq"] == 10
        assert job.wait(30) == JobState.SUCCEEDED
        events = list(job.events(follow=False))
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        shown = [line for e in events for line in (e.lines if e.type.value == "log" else [e.type.value])
                 if e.type.value in ("log", "progress")]
        assert shown == ["a\n", "b\n", "c\n", "progress", "d\n", "e\n", "f\n"]
        assert job.logs() == "abcdef".replace("", "\n")[1:]
        assert list(queued.events(follow=False))[-1].type.value != "log" and queued.logs() == ""


# ---------------------------------------------------------------- 10: the README's move commands


def test_cli_preempt_and_checkpoint_end_cleanly(two_nodes):
    env = {**os.environ, "SINGULARITY_URL": two_nodes.url, "SINGULARITY_TOKEN": two_nodes.token}
    with two_nodes.client() as c:
        job = c.submit(SLEEPER, name="cli")
        wait_state(job, {JobState.RUNNING})

        def ctl(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "singularity_sdk.cli", *args], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)

        for args, said in ((("checkpoint", job.id), "checkpoint"), (("preempt", job.id), "preempted"),
                           (("resume", job.id), "queued")):
            r = ctl(*args)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
            assert r.stdout.startswith(f"{job.id}: ") and said in r.stdout, r.stdout
        wait_state(job, {JobState.RUNNING})
        job.cancel()
        wait_state(job, {JobState.CANCELLED})
