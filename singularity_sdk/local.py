"""``LocalCluster``: a real server and real node agents on this machine, in a temporary home.

Everything runs as it would on a cluster (separate processes, HTTP, WebSockets, SQLite), so a
script written against a LocalCluster works unchanged against a shared one. It is also how the
tests and the demo run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .aio import AsyncClient
from .client import Client
from .config import HOME_ENV, SANDBOX_ENV
from .errors import SingularityError


def launch_serve(home: Path, args: list[str], env: dict[str, str], log_path: Path, *,
                 new_session: bool = False) -> subprocess.Popen:
    """Start ``python -m backend serve --home HOME ARGS`` with its output in ``log_path``: the one
    way this package and the Jupyter extension start a server. A server.json left by an
    earlier server is removed first, so `wait_for_serve` reads this one's."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.json").unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "backend", "serve", "--home", str(home), *args],
                                env={**env, HOME_ENV: str(home)}, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=new_session)


def wait_for_serve(home: Path, proc: subprocess.Popen, timeout: float, log_path: Path) -> dict[str, Any]:
    """The started server's server.json (url, token, agent_token, pid, ca); SingularityError with
    the end of its log if it exits or does not answer within ``timeout``."""
    deadline = time.monotonic() + timeout
    path = home / "server.json"
    while True:
        try:
            info = json.loads(path.read_text())
            if isinstance(info, dict) and info.get("pid") in (None, proc.pid) and info.get("url"):
                return info
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"did not start within {timeout:g}s"
            try:
                tail = log_path.read_text(errors="replace")[-3000:]
            except OSError:
                tail = ""
            raise SingularityError(f"the Singularity server {why}; see {log_path}:\n{tail}")
        time.sleep(0.05)


class LocalCluster:
    def __init__(self, nodes: int = 2, devices_per_node: int = 2, *, home: Optional[Path] = None,
                 port: int = 0, start_timeout: float = 60.0, env: Optional[dict[str, str]] = None,
                 store: Optional[str] = None, node_timeout: Optional[float] = None,
                 checkpoint_every: Optional[float] = None, policy: Optional[str] = None,
                 min_move_interval: Optional[float] = None, move_cost: Optional[float] = None,
                 checkpoint_timeout: Optional[float] = None, tls_cert: Optional[Path] = None,
                 tls_key: Optional[Path] = None, ray: Optional[str] = None, sandbox: Optional[str] = None,
                 stop_timeout: Optional[float] = None, run_as: Optional[Path] = None):
        #: with ``ray`` (an address as for ``ray.init``), agents run on the Ray cluster's GPU
        #: nodes instead of locally, and ``nodes`` is how many of them to wait for
        self.ray = ray
        #: ``SINGULARITY_SANDBOX`` for the agents (auto | bwrap | off). A local cluster runs one
        #: person's jobs with that person's rights, so a sandbox protects nothing from them and
        #: costs every start a fresh interpreter: off unless asked for here or in the environment
        self.sandbox = sandbox
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self._own_home = home is None
        self.home = Path(home) if home else Path(tempfile.mkdtemp(prefix="singularity-"))
        self.port = port
        self.start_timeout = start_timeout
        self.env = env or {}
        self.extra_args: list[str] = []
        if store:
            self.extra_args += ["--store", store]
        if node_timeout is not None:
            self.extra_args += ["--node-timeout", str(node_timeout)]
        if checkpoint_every is not None:
            self.extra_args += ["--checkpoint-every", str(checkpoint_every)]
        if policy is not None:
            self.extra_args += ["--policy", policy]
        if min_move_interval is not None:
            self.extra_args += ["--min-move-interval", str(min_move_interval)]
        if move_cost is not None:
            self.extra_args += ["--move-cost", str(move_cost)]
        if checkpoint_timeout is not None:
            self.extra_args += ["--checkpoint-timeout", str(checkpoint_timeout)]
        if run_as is not None:  # each user's jobs as their OS account (serve --run-as)
            self.extra_args += ["--run-as", str(run_as)]
        if tls_cert is not None and tls_key is not None:
            self.extra_args += ["--tls-cert", str(tls_cert), "--tls-key", str(tls_key)]
        if ray is not None:
            self.extra_args += ["--ray", ray]
        #: on close, how long running jobs have to checkpoint (they resume when a cluster starts
        #: again on the same home); a temporary home is deleted on close, so it gets none
        self.stop_timeout = stop_timeout if stop_timeout is not None else (0.0 if self._own_home else 10.0)
        self.extra_args += ["--stop-timeout", f"{self.stop_timeout:g}"]
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.token = ""
        self.agent_token = ""
        #: the CA clients trust when the cluster serves TLS (from server.json)
        self.ca: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "LocalCluster":
        args = ["--port", str(self.port), "--nodes", str(0 if self.ray else self.nodes),
                "--devices-per-node", str(self.devices_per_node), *self.extra_args]
        env = {**os.environ, **self.env}
        if self.sandbox is not None:
            env[SANDBOX_ENV] = self.sandbox
        else:
            env.setdefault(SANDBOX_ENV, "off")
        deadline = time.monotonic() + self.start_timeout
        self.proc = launch_serve(self.home, args, env, self.home / "server.log")
        info = wait_for_serve(self.home, self.proc, self.start_timeout, self.home / "server.log")
        self.url, self.token, self.agent_token = info["url"], info["token"], info["agent_token"]
        self.ca = info.get("ca")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.wait_for_nodes(deadline)
        return self

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = (self.home / "server.log").read_text(errors="replace")[-3000:]
            raise SingularityError(f"the local server exited with code {self.proc.returncode}:\n{tail}")

    def wait_for_nodes(self, deadline: Optional[float] = None) -> None:
        """Wait until every local node agent has registered and is ready."""
        deadline = deadline or time.monotonic() + self.start_timeout
        with self.client() as c:
            while True:
                self._check_alive()
                ready = [n for n in c.nodes() if n.state.value == "ready"]
                if len(ready) >= self.nodes and c.health()["nodes"] >= self.nodes:
                    return
                if time.monotonic() > deadline:
                    raise SingularityError(f"only {len(ready)} of {self.nodes} node agents registered; "
                                           f"see {self.home}/logs/")
                time.sleep(0.05)

    def client(self, token: Optional[str] = None) -> Client:
        return Client(self.url, token or self.token, ca=self.ca)

    def async_client(self, token: Optional[str] = None) -> AsyncClient:
        return AsyncClient(self.url, token or self.token, ca=self.ca)

    def agent_pids(self) -> dict[str, int]:
        out = {}
        for f in sorted((self.home / "agents").glob("*.pid")):
            try:
                out[f.stem] = int(f.read_text())
            except (OSError, ValueError):
                pass
        return out

    def kill_server(self) -> None:
        """``kill -9`` the server (agents and workers keep running), for failure testing."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def restart_server(self) -> None:
        """Start the server again on the same home and port; live agents reconnect to it."""
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout + 20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        for pid in self.agent_pids().values():  # after a crash the server could not stop them
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close()
