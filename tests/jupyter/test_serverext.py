"""The jupyter-server extension: embedded backend, API behind Jupyter's auth, clean stop; and the
backend manager's adopt / restart / connect behaviour, all with real processes."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from jupyter_ext.embedded import MARKER, BackendManager
from jupyter_helpers import JupyterProcess, ROOT, wait_until
from processes import pid_alive
from singularity_sdk import Client, LocalCluster


def kernel_pid(kernel_id: str) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"kernel-{kernel_id}.json".encode() in (proc / "cmdline").read_bytes():
                    return int(proc.name)
            except OSError:
                continue
    raise AssertionError(f"no process for kernel {kernel_id}")


@pytest.fixture()
def clean_env(monkeypatch):
    """No SINGULARITY_URL/_TOKEN from other tests: the manager would connect to that server."""
    for name in ("SINGULARITY_URL", "SINGULARITY_TOKEN", "SINGULARITY_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_server_extension_lifecycle(tmp_path):
    jp = JupyterProcess("server", tmp_path)
    api = f"{jp.url}/singularity/api/v1"
    try:
        status = httpx.get(f"{jp.url}/singularity/status", headers=jp.headers).json()
        assert status["mode"] == "embedded" and status["owned"] and status["home"] == str(jp.home)
        assert "token" not in json.dumps(status)
        backend_pid = status["pid"]
        assert pid_alive(backend_pid) and json.loads((jp.home / "server.json").read_text())["pid"] == backend_pid

        # Jupyter's own auth guards the API; the backend's token never reaches the browser.
        assert httpx.get(f"{api}/health").status_code == 403
        assert httpx.get(f"{api}/health", headers={"Authorization": "token wrong"}).status_code == 403
        # The backend answers before its node agent has registered (a job submitted meanwhile queues).
        def health() -> dict:
            return httpx.get(f"{api}/health", headers=jp.headers).json()
        assert health()["ok"]
        wait_until(lambda: health()["nodes"] == 1, timeout=60, what="the embedded node agent to register")

        r = httpx.post(f"{api}/jobs", headers=jp.headers, json={"source": "print('via jupyter')\n6 * 7", "name": "proxied"})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        bad = httpx.post(f"{api}/jobs", headers=jp.headers, json={"source": "1", "gpus": 0})
        assert bad.status_code == 422 and bad.json()["field"] == "gpus"  # the backend's answer, as it was
        assert httpx.get(f"{api}/agents/ws", headers=jp.headers).status_code == 404

        ws_base = jp.url.replace("http://", "ws://")
        types = []
        with ws_connect(f"{ws_base}/singularity/api/v1/jobs/{job_id}/events/ws?since=0",
                        additional_headers=jp.headers, open_timeout=10) as ws:
            while not types or types[-1] not in ("succeeded", "failed", "cancelled"):
                types.append(json.loads(ws.recv(timeout=30))["type"])
        assert types[0] == "submitted" and types[-1] == "succeeded" and "log" in types
        logs = httpx.get(f"{api}/jobs/{job_id}/logs", headers=jp.headers)
        assert logs.text == "via jupyter\n" and logs.headers["content-type"].startswith("text/plain")
        with pytest.raises(InvalidStatus) as refused:
            with ws_connect(f"{ws_base}/singularity/api/v1/events/ws", open_timeout=10):
                pass
        assert refused.value.response.status_code == 403

        # A kernel this Jupyter starts finds the backend with no setup.
        kernel = httpx.post(f"{jp.url}/api/kernels", headers=jp.headers, json={"name": "python3"}).json()
        env = dict(item.split(b"=", 1) for item in
                   Path(f"/proc/{kernel_pid(kernel['id'])}/environ").read_bytes().split(b"\0") if b"=" in item)
        assert env[b"SINGULARITY_HOME"].decode() == str(jp.home)
        assert Client(home=jp.home).health()["ok"]
    finally:
        rc = jp.stop()
    assert rc == 0, jp.log()
    assert not pid_alive(backend_pid), "the backend must stop with the Jupyter server"
    assert not (jp.home / "server.json").exists() and not (jp.home / MARKER).exists()
    assert not list((jp.home / "agents").glob("*.pid")), "the local agents must stop too"


def test_shared_server_is_used_and_left_running(tmp_path, clean_env):
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "home") as cluster:
        m = BackendManager(home=str(cluster.home))
        info = m.start()
        assert info.mode == "shared" and not info.owned and info.url == cluster.url
        m.stop()
        assert cluster.client().health()["ok"]  # someone's own `singularityctl serve` is left alone


def test_backend_restarts_on_its_port_and_is_adopted_after_a_jupyter_crash(tmp_path, clean_env):
    home = tmp_path / "home"
    first = BackendManager(home=str(home), nodes=1, devices_per_node=1)
    info = first.start()
    try:
        assert info.mode == "embedded" and info.owned and (home / MARKER).exists()
        url, old_pid = info.url, info.pid
        os.kill(old_pid, signal.SIGKILL)
        first.proc.wait()
        assert first.check() == "restarted"
        assert first.info.url == url and first.info.pid != old_pid  # same port: kernels keep their URL
        with Client(url, first.info.token) as c:
            try:
                wait_until(lambda: c.health()["nodes"] == 1, timeout=45, interval=0.1, what="the agent to reconnect")
            except AssertionError:
                print(*(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in (home / "logs").glob("*.log")), sep="\n")
                raise
        # A Jupyter that died without stopping it: the next one on the same home takes it over.
        second = BackendManager(home=str(home))
        adopted = second.start()
        pid = adopted.pid
        assert adopted.mode == "adopted" and adopted.owned and pid == first.info.pid
        second.stop()
        assert not pid_alive(pid) and not (home / "server.json").exists()
    finally:
        first.stop()


def test_connect_mode_exports_url_and_token(jcluster, monkeypatch, clean_env):
    m = BackendManager(url=jcluster.url, token=jcluster.token)
    info = m.start()
    assert info.mode == "external" and info.ready and not info.owned
    m.export_env()
    assert os.environ["SINGULARITY_URL"] == jcluster.url and os.environ["SINGULARITY_TOKEN"] == jcluster.token
    m.stop()
    assert jcluster.client().health()["ok"]
    monkeypatch.delenv("SINGULARITY_TOKEN")
    monkeypatch.setenv("SINGULARITY_HOME", str(jcluster.home / "nowhere"))
    missing = BackendManager(url="http://127.0.0.1:9").start()
    assert not missing.ready and "no token" in missing.error


def test_config_file_enables_the_extension():
    config = json.loads((ROOT / "jupyter-config" / "jupyter_server_config.d" / "jupyter_ext.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"jupyter_ext": True}}}
    import jupyter_ext

    points = jupyter_ext._jupyter_server_extension_points()
    assert points[0]["module"] == "jupyter_ext" and points[0]["app"].name == "jupyter_ext"
