"""Helpers shared by the Jupyter tests (kept out of conftest.py, which another folder also has)."""
from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path
from typing import Any, Optional

from singularity_sdk import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
LONG_LOOP = "import time\nfor i in range(100000):\n    print('tick', i, flush=True)\n    time.sleep(0.02)\n'finished'"


def magics(ip: Any):
    return ip._singularity_magics


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition") -> float:
    """Poll ``predicate`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def kernel_env(cluster: LocalCluster, **extra: str) -> dict[str, str]:
    env = {**os.environ, "SINGULARITY_URL": cluster.url, "SINGULARITY_TOKEN": cluster.token,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **extra}
    env.pop("SINGULARITY_NONINTERACTIVE", None)
    return env


class Kernel:
    """A real ipykernel, driven through jupyter_client, recording iopub with arrival times."""

    def __init__(self, env: dict[str, str]):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, extra_arguments=["--HistoryManager.enabled=False"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def execute(self, code: str, timeout: float = 60.0, on_output=None) -> tuple[dict, list[tuple[float, dict]]]:
        """Run ``code``; returns the execute_reply content and [(time, iopub msg)] of that request."""
        msg_id = self.kc.execute(code)
        outputs: list[tuple[float, dict]] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no idle from the kernel within {timeout}s; got {outputs[-5:]}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            outputs.append((time.monotonic(), msg))
            if on_output is not None:
                on_output(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=10)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=10)
        return reply["content"], outputs

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def stream_text(outputs: list[tuple[float, dict]], name: Optional[str] = None) -> str:
    return "".join(m["content"]["text"] for _, m in outputs
                   if m["msg_type"] == "stream" and (name is None or m["content"]["name"] == name))


def latest_job(client, name: str):
    jobs = [j for j in client.jobs() if j.name == name]
    assert jobs, f"no job named {name!r}"
    return jobs[-1]


def cancel_quietly(job) -> None:
    if not job.refresh().state.is_terminal:
        job.cancel()
    job.wait(30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterProcess:
    """``jupyter server`` or ``jupyter lab`` with the server extension, isolated in ``root``:
    its own config, data, settings and Singularity home; no SINGULARITY_URL, so the extension
    starts its embedded backend exactly as for a newcomer."""

    def __init__(self, app: str, root: Path, *extra: str, env: Optional[dict[str, str]] = None):
        import subprocess

        self.root = root
        self.port = free_port()
        self.token = "jupyter-test-token"
        self.home = root / "singularity-home"
        self.url = f"http://127.0.0.1:{self.port}"
        (root / "work").mkdir(parents=True, exist_ok=True)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("SINGULARITY_")}
        base_env.update({
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "JUPYTER_CONFIG_DIR": str(root / "config"), "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(root / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(root / "lab-workspaces"), "IPYTHONDIR": str(root / "ipython"),
            **(env or {}),
        })
        cmd = [sys.executable, "-m", "jupyter", app, "--no-browser", "--allow-root", f"--port={self.port}",
               "--ip=127.0.0.1", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root / 'work'}",
               '--ServerApp.jpserver_extensions={"jupyter_ext": True}', f"--SingularityApp.home={self.home}",
               "--SingularityApp.devices_per_node=2", *extra]
        self.log_path = root / f"{app}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=base_env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=root)
        self.wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/singularity/status", headers=self.headers, timeout=2)
                if r.status_code == 200 and r.json()["ready"]:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"jupyter did not come up in {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
