"""Every endpoint against every kind of caller: the owner, another user, the admin, a node's
credential, the join token and no token. Another user's job answers 404 exactly like an
unknown one; credentials of nodes open nothing of the user API; nothing changes hands."""
from __future__ import annotations

import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from singularity_sdk import JobState, LocalCluster

SLEEPER = "import time\nfor i in range(100000):\n    time.sleep(0.05)\n"


@pytest.fixture(scope="module")
def setup():
    with LocalCluster(nodes=1, devices_per_node=2) as cluster:
        admin = {"Authorization": f"Bearer {cluster.token}"}
        with httpx.Client(base_url=cluster.url + "/api/v1", timeout=30) as h:
            tokens = {name: h.post("/users", json={"user": name}, headers=admin).json()["token"]
                      for name in ("owner", "other")}
        tokens.update(admin=cluster.token, join=cluster.agent_token,
                      node=(cluster.home / "agents" / "node-1" / "credential").read_text().strip())
        with cluster.client(tokens["owner"]) as c:
            job = c.submit(SLEEPER, name="owned")
            deadline = time.monotonic() + 60
            while job.refresh().state != JobState.RUNNING:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            yield cluster, tokens, job.id
            job.cancel()


def _endpoints(job_id: str) -> list[tuple[str, str, dict]]:
    """Requests that read or change the job without ending it (cancel is checked last)."""
    return [("GET", f"/jobs/{job_id}", {}), ("GET", f"/jobs/{job_id}/events", {}),
            ("GET", f"/jobs/{job_id}/logs", {}), ("GET", f"/jobs/{job_id}/result", {}),
            ("POST", f"/jobs/{job_id}/resume", {}), ("POST", f"/jobs/{job_id}/resize", {"gpus": 1}),
            ("POST", f"/jobs/{job_id}/migrate", {})]


def test_every_job_endpoint_by_every_caller(setup):
    cluster, tokens, job_id = setup
    with httpx.Client(base_url=cluster.url + "/api/v1", timeout=30) as h:
        for method, path, body in _endpoints(job_id):
            kw = {"json": body} if method == "POST" else {}
            seen = {}
            for who in ("none", "node", "join", "other", "admin", "owner"):
                headers = {} if who == "none" else {"Authorization": f"Bearer {tokens[who]}"}
                seen[who] = h.request(method, path, headers=headers, **kw).status_code
            assert seen["none"] == 401 and seen["node"] == seen["join"] == 403, (path, seen)
            # The admin is a user too: someone else's job is as unknown to them as to anyone.
            assert seen["other"] == seen["admin"] == 404, (path, seen)
            assert seen["owner"] not in (401, 403, 404), (path, seen)
            unknown = h.request(method, path.replace(job_id, "j-000000"), headers={
                "Authorization": f"Bearer {tokens['other']}"}, **kw)
            assert unknown.status_code == 404
        for who in ("other", "admin"):
            r = h.post(f"/jobs/{job_id}/cancel", json={}, headers={"Authorization": f"Bearer {tokens[who]}"})
            assert r.status_code == 404
            listed = h.get("/jobs", headers={"Authorization": f"Bearer {tokens[who]}"}).json()
            assert job_id not in [j["id"] for j in listed]
    with cluster.client(tokens["owner"]) as c:
        assert c.get(job_id).state == JobState.RUNNING


def test_cluster_endpoints_by_every_caller(setup):
    cluster, tokens, job_id = setup
    with httpx.Client(base_url=cluster.url + "/api/v1", timeout=30) as h:
        def call(method: str, path: str, who: str, body=None) -> int:
            headers = {} if who == "none" else {"Authorization": f"Bearer {tokens[who]}"}
            return h.request(method, path, headers=headers, json=body).status_code

        for who, want in (("none", 401), ("node", 403), ("join", 403), ("other", 403), ("owner", 403)):
            assert call("POST", "/users", who, {"user": "eve"}) == want, who
            assert call("POST", "/nodes/node-1/drain", who, {}) == want, who
        for who, want in (("none", 401), ("node", 403), ("join", 403), ("other", 200), ("admin", 200)):
            assert call("GET", "/nodes", who) == want, who
            assert call("GET", "/health", who) == want, who
        # enrolling: the join token once per name, never a node's or a user's credential
        for who, want in (("none", 401), ("node", 403), ("other", 403), ("join", 409)):
            assert call("POST", "/nodes/node-1/enroll", who, {}) == want, who
    for who in ("owner", "admin", "join"):
        with pytest.raises(InvalidStatus) as info:
            connect(cluster.url.replace("http", "ws") + "/api/v1/agents/ws",
                    additional_headers={"Authorization": f"Bearer {tokens[who]}"})
        assert info.value.response.status_code == 403
    for who, want in (("node", 403), ("join", 403), ("other", 404), ("none", 401)):
        headers = {} if who == "none" else {"Authorization": f"Bearer {tokens[who]}"}
        with pytest.raises(InvalidStatus) as info:
            connect(cluster.url.replace("http", "ws") + f"/api/v1/jobs/{job_id}/events/ws", additional_headers=headers)
        assert info.value.response.status_code == want, who
