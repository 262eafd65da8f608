"""Seeded fuzzing of the REST API and the agent channel: thousands of hostile requests and agent
messages, and afterwards the server is alive, never answered 5xx, and the admin's jobs, their
events and the cluster's nodes are exactly as before."""
from __future__ import annotations

import json
import random
import time
from contextlib import ExitStack
from typing import Any

import httpx
from websockets.sync.client import connect

from singularity_sdk import EventType, JobState, LocalCluster

SEED = 13
REQUESTS = 2000
AGENT_MESSAGES = 600
ACTIONS = ("cancel", "preempt", "resume", "checkpoint", "migrate", "resize", "explode", "")
NASTY_STRINGS = ["", "\x00", "a\x00b", "../../etc/passwd", "é" * 300, "x" * 70_000, "${HOME}", "%00", "\ud800",
                 "<script>", "j-000000", "node-1", "A=B", "1e400", "NaN"]


def _nasty_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(NASTY_STRINGS)
    if kind == 1:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 4096, 4097])
    if kind == 2:
        return rng.choice([0.0, -0.5, 1e308, float("inf"), float("nan")])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4 and depth < 6:
        return [_nasty_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5 and depth < 6:
        return {rng.choice(NASTY_STRINGS + ["source", "gpus", "env"]): _nasty_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if kind == 6:
        return rng.choice(["[" * 5000, "{" * 40])
    return rng.choice(NASTY_STRINGS)


def _nasty_body(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return ("[" * rng.choice([40, 5000, 200_000]) + "]" * rng.choice([0, 40, 5000])).encode()
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if kind == 2:
        return b'{"source": "x=1", "gpus": 1e400}'
    if kind == 3:
        return b'{"a": NaN, "b": Infinity}'
    fields = ["source", "callable_b64", "filename", "inputs_b64", "outputs", "name", "gpus", "ranks", "sla",
              "checkpoint_every", "env", "args", "workdir", "workdir_b64", "reason", "node", "checkpoint_timeout",
              "user", "bogus"]
    body = {rng.choice(fields): _nasty_value(rng) for _ in range(rng.randrange(1, 5))}
    try:
        return json.dumps(body).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        return b"{}"


def _snapshot(cluster: LocalCluster, job_ids: list[str]) -> Any:
    with cluster.client() as c:
        jobs = [(j.info.id, j.info.state, j.info.attempt, j.info.last_seq) for j in c.jobs()]
        events = {jid: [(e.seq, e.type, e.data) for e in c.get(jid).events(follow=False)] for jid in job_ids}
        nodes = [(n.name, n.state, len(n.devices), sorted(n.used.items())) for n in c.nodes() if n.name != "fuzz-node"]
        return jobs, events, nodes


def test_hostile_requests_and_agent_messages_change_nothing(tmp_path):
    rng = random.Random(SEED)
    with LocalCluster(nodes=1, devices_per_node=2, home=tmp_path / "home") as cluster, ExitStack() as stack:
        http = httpx.Client(base_url=cluster.url + "/api/v1", timeout=30)
        admin = {"Authorization": f"Bearer {cluster.token}"}
        mallory = http.post("/users", json={"user": "mallory"}, headers=admin).json()["token"]
        node_token = http.post("/nodes/fuzz-node/enroll", json={},
                               headers={"Authorization": f"Bearer {cluster.agent_token}"}).json()["token"]
        with cluster.client() as c:
            done = c.submit("print('done')\n42")
            assert done.wait(60) == JobState.SUCCEEDED
            running = c.submit("import time\nfor i in range(100000):\n    time.sleep(0.05)\n", name="runs")
            # RUNNING is set when the job is placed; its worker reports `started` a moment later
            deadline = time.monotonic() + 60
            while not any(e.type == EventType.STARTED for e in running.events(follow=False)):
                assert time.monotonic() < deadline, "the job's worker never started"
                time.sleep(0.05)
        ws = stack.enter_context(connect(cluster.url.replace("http", "ws") + "/api/v1/agents/ws",
                                         additional_headers={"Authorization": f"Bearer {node_token}"}))
        ws.send(json.dumps({"type": "hello", "node": "fuzz-node", "instance": "fuzz", "devices": []}))
        assert json.loads(ws.recv(timeout=30))["type"] == "welcome"
        # A live agent beats every second; one silent for the server's node timeout is closed
        # (4408), which a slow machine reached during the HTTP fuzzing. Beat as an agent does.
        beat_at = [time.monotonic()]

        def beat() -> None:
            if time.monotonic() - beat_at[0] >= 1.0:
                ws.send(json.dumps({"type": "heartbeat", "time": time.time()}))
                beat_at[0] = time.monotonic()

        before = _snapshot(cluster, [done.id, running.id])
        # the running job's log grows while we fuzz; compare its events up to now only
        cut = before[1][running.id][-1][0]

        tokens = [None, "garbage", mallory, node_token, cluster.agent_token, "x" * 10_000]
        ids = [done.id, running.id, "j-000000", "j-" + "a" * 300, "..%2f..%2fetc", "%00"]
        statuses: dict[int, int] = {}
        for i in range(REQUESTS):
            beat()
            token = rng.choice(tokens)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            jid = rng.choice(ids)
            path = rng.choice([
                "/jobs", f"/jobs/{jid}", f"/jobs/{jid}/{rng.choice(ACTIONS)}", f"/jobs/{jid}/events",
                f"/jobs/{jid}/logs", f"/jobs/{jid}/result", "/nodes", f"/nodes/{rng.choice(['node-1', 'x'])}/drain",
                "/nodes/node-1/enroll", "/users", "/health", "/nope"])
            params = {rng.choice(["since", "state", "token"]): str(_nasty_value(rng))[:200]
                      .encode("utf-8", "replace").decode()} if rng.random() < 0.3 else None
            if i % 10 == 0:  # the admin's token, with bodies no model accepts
                headers, body, method = admin, rng.choice([b"[" * 100_000, b'{"bogus": 1}', b'{"reason": "\\u0000"}']), "POST"
            else:
                method, body = rng.choice(["GET", "POST", "POST", "DELETE", "PUT"]), _nasty_body(rng)
            r = http.request(method, path, content=body if method != "GET" else None, params=params, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
            assert "Traceback" not in r.text and "internal error:" not in r.text

        for i in range(AGENT_MESSAGES):
            beat()
            kind = rng.randrange(6)
            if kind == 0:
                msg = _nasty_body(rng).decode("utf-8", "replace")
            elif kind == 1:
                msg = json.dumps({"type": "hello", "node": rng.choice(["node-1", "fuzz-node", "x"]),
                                  "instance": "fuzz", "devices": _nasty_value(rng)})
            else:
                ev = {"agent_seq": rng.choice([1, 2**62, 2**63, -1, "x"]), "job_id": rng.choice(ids),
                      "attempt": rng.choice([0, 1, 2, 2**63, "a"]),
                      "type": rng.choice(["log", "worker_exited", "result", "resumed", "checkpointed", "bogus"]),
                      "time": rng.choice([time.time(), float("nan"), "now"]), "data": _nasty_value(rng)}
                msg = json.dumps({"type": "events", "events": [ev]})
            if msg.startswith('{"type": "hello", "node": "fuzz-node"'):
                continue  # a valid re-hello is not hostile
            ws.send(msg)
        ws.send(json.dumps({"type": "heartbeat", "time": time.time()}))
        ws.send(json.dumps({"type": "events", "events": [
            {"agent_seq": 2**62, "job_id": running.id, "attempt": 1, "type": "log", "time": time.time(),
             "data": {"rank": 0, "stream": "stdout", "line": "x\n"}}]}))
        deadline = time.monotonic() + 60
        while True:  # the connection stayed: the last batch is acknowledged
            msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("type") == "ack" and msg.get("agent_seq") == 2**62:
                break
        http.close()

        after = _snapshot(cluster, [done.id, running.id])
        jobs_before = [(j, s, a) for j, s, a, _ in before[0]]
        jobs_after = [(j, s, a) for j, s, a, _ in after[0]]
        assert jobs_after == jobs_before
        assert after[1][done.id] == before[1][done.id]
        assert [e for e in after[1][running.id] if e[0] <= cut] == before[1][running.id]
        own = {"log", "progress", "telemetry", "interruptible", "exactness"}  # what the running job reports itself
        assert not [e for e in after[1][running.id] if e[0] > cut and e[1].value not in own]
        assert after[2] == before[2]
        assert sum(statuses.values()) == REQUESTS and set(statuses) <= set(range(200, 500))
