"""Find, start, watch and stop the backend that a Jupyter server hands to its kernels.

The backend is ``singularityctl serve`` as a child process in its own session, not tornado
handlers inside the Jupyter process: Jupyter's event loop then never waits on SQLite or on the
scheduler, a Jupyter crash leaves running jobs alone (the next Jupyter adopts the backend through
``server.json``), and Ctrl-C in Jupyter's terminal reaches only Jupyter, which stops the backend
in order. The backend keeps its port across restarts, so kernels and agents that know its URL
reconnect by themselves.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from singularity_sdk.config import HOME_ENV, TOKEN_ENV, URL_ENV, default_home
from singularity_sdk.errors import SingularityError
from singularity_sdk.local import launch_serve, wait_for_serve
from singularity_sdk.protocol import API_PREFIX

MARKER = "jupyter_ext.json"  # in the home: "this backend was started by a Jupyter server"
#: when Jupyter stops, how long the embedded backend's running jobs have to checkpoint (they
#: are queued again and resume when Jupyter and its backend start on the same home)
STOP_TIMEOUT_S = 10.0


@dataclass
class BackendInfo:
    """Where the kernels' backend is. ``mode``: ``embedded`` (started here), ``adopted`` (started
    by an earlier Jupyter on the same home), ``shared`` (someone's ``singularityctl serve``) or
    ``external`` (a configured URL)."""

    mode: str
    url: str = ""
    token: str = ""
    home: Optional[Path] = None
    pid: Optional[int] = None
    owned: bool = False
    error: Optional[str] = None

    @property
    def ready(self) -> bool:
        return bool(self.url and self.token and not self.error)

    def public(self) -> dict:
        """What ``/singularity/status`` shows (never the token)."""
        return {"mode": self.mode, "url": self.url, "home": str(self.home) if self.home else None,
                "pid": self.pid, "owned": self.owned, "ready": self.ready, "error": self.error}


class BackendManager:
    def __init__(self, *, url: str = "", token: str = "", home: str = "", nodes: int = 1,
                 devices_per_node: int = 0, start_timeout: float = 60.0, log: Optional[logging.Logger] = None,
                 ray: str = "", store: str = ""):
        #: a Ray address: agents run on the Ray cluster's GPU nodes instead of locally
        self.ray = ray
        self.store = store
        self.url = url
        self.token = token
        self.home = Path(home).expanduser() if home else None
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self.start_timeout = start_timeout
        self.log = log or logging.getLogger("jupyter_ext")
        self.info = BackendInfo(mode="none")
        self.proc: Optional[subprocess.Popen] = None
        self._port = 0
        self._atexit = False

    # ------------------------------------------------------------------ start
    def start(self) -> BackendInfo:
        """Connect to the configured server, else adopt or start one on the home."""
        url = self.url or os.environ.get(URL_ENV, "")
        if url:
            token = self.token or os.environ.get(TOKEN_ENV, "") or self._token_from_home()
            self.info = BackendInfo(mode="external", url=url.rstrip("/"), token=token)
            if not token:
                self.info.error = f"no token for {url}: set SingularityApp.token or SINGULARITY_TOKEN"
            elif not _healthy(self.info.url, token):
                self.log.warning("Singularity server %s does not answer (yet); kernels will retry", url)
            return self.info
        home = self.home or default_home()
        home.mkdir(parents=True, exist_ok=True)
        found = _read_server_json(home)
        if found and _healthy(found["url"], found["token"]):
            marker = _read_json(home / MARKER)
            owned = bool(marker) and marker.get("backend_pid") == found.get("pid")
            self.info = BackendInfo(mode="adopted" if owned else "shared", url=found["url"], token=found["token"],
                                    home=home, pid=found.get("pid"), owned=owned)
            self._port = _port_of(found["url"])
            self.log.info("Singularity: using the server already running on %s (%s)", home, self.info.url)
            return self.info
        return self._launch(home)

    def _launch(self, home: Path) -> BackendInfo:
        args = ["--port", str(self._port), "--nodes", str(0 if self.ray else self.nodes),
                "--stop-timeout", f"{STOP_TIMEOUT_S:g}"]
        if self.ray:
            args += ["--ray", self.ray]
        if self.store:
            args += ["--store", self.store]
        if self.devices_per_node:
            args += ["--devices-per-node", str(self.devices_per_node)]
        env = {k: v for k, v in os.environ.items() if k not in (URL_ENV, TOKEN_ENV)}
        log_path = home / "logs" / "jupyter-backend.log"
        self.proc = launch_serve(home, args, env, log_path, new_session=True)
        try:
            found = wait_for_serve(home, self.proc, self.start_timeout, log_path)
        except SingularityError as exc:
            self.info = BackendInfo(mode="embedded", home=home, owned=True, error=str(exc))
            self.log.error("%s", self.info.error)
            self.stop()
            return self.info
        _write_json(home / MARKER, {"backend_pid": self.proc.pid, "jupyter_pid": os.getpid()})
        if not self._atexit:  # Jupyter may exit without stopping its extensions (e.g. a startup error)
            atexit.register(self.stop)
            self._atexit = True
        self._port = _port_of(found["url"])
        self.info = BackendInfo(mode="embedded", url=found["url"], token=found["token"], home=home,
                                pid=self.proc.pid, owned=True)
        self.log.info("Singularity: started a backend with %d local node(s) on %s (home %s)", self.nodes,
                      self.info.url, home)
        return self.info

    def _token_from_home(self) -> str:
        found = _read_server_json(self.home or default_home())
        return found["token"] if found else ""

    # ------------------------------------------------------------------ watch
    def check(self) -> Optional[str]:
        """Restart an owned backend that died (same home, same port). Returns what was done."""
        info = self.info
        if not info.owned or info.home is None or info.pid is None:
            return None
        if self.proc is not None:
            dead = self.proc.poll() is not None
        else:
            dead = not _pid_alive(info.pid)
        if not dead:
            return None
        self.log.warning("Singularity: the backend (pid %s) exited; starting it again on port %s", info.pid, self._port)
        self._launch(info.home)
        return "restarted" if self.info.ready else f"restart failed: {self.info.error}"

    # ------------------------------------------------------------------ env
    def export_env(self) -> None:
        """Make kernels started from now on find this backend with no setup."""
        info = self.info
        if info.mode == "external":
            if info.url and info.token:
                os.environ[URL_ENV] = info.url
                os.environ[TOKEN_ENV] = info.token
        elif info.home is not None:
            os.environ[HOME_ENV] = str(info.home)

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = STOP_TIMEOUT_S + 20.0) -> None:
        """Stop the backend if this Jupyter answers for it: SIGTERM (the server stops its agents
        and removes server.json), SIGKILL after ``timeout``. Another's backend is left alone."""
        info = self.info
        pid = self.proc.pid if self.proc is not None else (info.pid if info.owned else None)
        if pid is None:
            return
        self.log.info("Singularity: stopping the backend (pid %s)", pid)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None:
                if self.proc.poll() is not None:
                    break
            elif not _pid_alive(pid):
                break
            time.sleep(0.05)
        else:
            self.log.warning("Singularity: the backend did not stop in %ss; killing it", timeout)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.proc is not None:
                self.proc.wait()
        if info.home is not None:
            marker = _read_json(info.home / MARKER)
            if marker.get("backend_pid") == pid:
                (info.home / MARKER).unlink(missing_ok=True)
        self.proc = None
        self.info.pid = None


def _healthy(url: str, token: str) -> bool:
    try:
        r = httpx.get(f"{url.rstrip('/')}{API_PREFIX}/health", headers={"Authorization": f"Bearer {token}"}, timeout=2)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _read_server_json(home: Path) -> Optional[dict]:
    data = _read_json(home / "server.json")
    return data if data.get("url") and data.get("token") else None


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _port_of(url: str) -> int:
    try:
        return int(url.rsplit(":", 1)[1].split("/")[0])
    except (IndexError, ValueError):
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True
