"""``singularityctl serve``: run the server, and optionally K local node agents beside it.

Local agents are separate processes in their own session, so a crash (``kill -9``) of the
server leaves them and their workers running; a restart on the same home finds them through
their pid files instead of starting duplicates.
"""
from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import tornado.httpserver
import tornado.netutil

from singularity_sdk.config import default_home
from singularity_sdk.protocol import NodeState, Shutdown

from backend.agent.credential import CREDENTIAL_FILE
from backend.contract import ENV_LOG_LEVEL
from backend.agent.credential import save as save_credential
from backend.agent.sandbox import JOB_UMASK_ENV

from .app import MAX_BODY_BYTES, install_schedule_coalescing, make_app
from .credentials import ADMIN_ROLE, JOIN_ROLE, NODE_ROLE, node_user
from .run_as import read_table
from .service import Service, ServiceConfig
from .store import Store
from .tls import plain_http_warning, server_context

log = logging.getLogger("singularity.server")


def write_private_json(path: Path, payload: dict) -> None:
    """Write ``payload`` readable by the owner only, atomically (readers never see half a file)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def service_tokens(store: Store, home: Path, user: str) -> tuple[str, str]:
    """The admin's and the join token. The store keeps only their hashes, so they are kept in
    ``credentials.json`` (0600) to survive restarts; a missing or stale one is issued anew."""
    path = home / "credentials.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    token, join = saved.get("token"), saved.get("agent_token")
    if not (token and saved.get("user") == user and store.token_is(user, token)):
        token = store.issue_token(user, ADMIN_ROLE)
    if not (join and store.token_is("agents", join)):
        join = store.issue_token("agents", JOIN_ROLE)
    write_private_json(path, {"user": user, "token": token, "agent_token": join})
    return token, join


def local_credential(store: Store, agent_home: Path, node: str) -> None:
    """Give a local agent its node credential in its home, keeping a valid one (an agent that
    survived a server crash goes on using it)."""
    path = agent_home / CREDENTIAL_FILE
    try:
        current = path.read_text().strip()
    except OSError:
        current = ""
    if not (current and store.token_is(node_user(node), current)):
        save_credential(path, store.issue_token(node_user(node), NODE_ROLE))


def _alive_agent(pid_file: Path) -> Optional[int]:
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"agent" in cmdline else None


def start_local_agents(home: Path, url: str, db: Store, nodes: int, devices: Optional[int],
                       store: Optional[str] = None, ca: Optional[str] = None, stop_timeout: float = 30.0,
                       lease: Optional[float] = None) -> list[int]:
    """Start (or adopt, after a restart) one agent process per local node.

    Without a store they share ``home/checkpoints``; with one, each keeps its own cache, as
    nodes that share no filesystem would."""
    agents_dir = home / "agents"
    agents_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    pids = []
    for i in range(1, nodes + 1):
        name = f"node-{i}"
        pid_file = agents_dir / f"{name}.pid"
        pid = _alive_agent(pid_file)
        local_credential(db, agents_dir / name, name)
        if pid is None:
            ckpt_root = agents_dir / name / "checkpoint-cache" if store else home / "checkpoints"
            cmd = [sys.executable, "-m", "backend.agent", "--server", url, "--name", name,
                   "--home", str(agents_dir / name), "--checkpoint-root", str(ckpt_root), "--orphan-timeout", "60",
                   "--stop-timeout", f"{stop_timeout:g}"]
            if lease is not None:  # a partitioned agent's jobs stop by the time this server gives up on it
                cmd += ["--lease", f"{lease:g}"]
            if store:
                cmd += ["--store", store]
            if ca:
                cmd += ["--ca", ca]
            if devices is not None:
                cmd += ["--devices", str(devices)]
            logf = open(home / "logs" / f"agent-{name}.log", "ab")
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            logf.close()
            pid = proc.pid
            pid_file.write_text(str(pid))
        pids.append(pid)
    return pids


def stop_local_agents(home: Path, pids: list[int], timeout: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    for pid in pids:
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # reap if it is our child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for f in (home / "agents").glob("*.pid"):
        f.unlink(missing_ok=True)


async def serve(home: Path, host: str = "127.0.0.1", port: int = 0, nodes: int = 0,
                devices_per_node: Optional[int] = None, config: ServiceConfig = ServiceConfig(),
                store_url: Optional[str] = None, tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                ca: Optional[str] = None, ray_address: Optional[str] = None, stop_timeout: float = 30.0) -> None:
    # The service's own files (state.db, logs, checkpoints) are the owner's only; jobs get the
    # umask serve was started with (backend/agent/sandbox.py).
    os.environ.setdefault(JOB_UMASK_ENV, f"{os.umask(0o077):03o}")
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    (home / "logs").mkdir(exist_ok=True)
    (home / "checkpoints").mkdir(exist_ok=True)
    store = Store(home / "state.db")
    user = os.environ.get("SINGULARITY_USER") or _login_name()
    token, agent_token = service_tokens(store, home, user)
    service = Service(store, config)
    install_schedule_coalescing(service)
    ssl_ctx = server_context(tls_cert, tls_key) if tls_cert and tls_key else None
    ca = (ca or tls_cert) if ssl_ctx else None  # a self-signed certificate is its own CA
    if warning := plain_http_warning(host, ssl_ctx is not None):
        log.warning(warning)
    server = tornado.httpserver.HTTPServer(make_app(service), ssl_options=ssl_ctx, max_body_size=4 * MAX_BODY_BYTES,
                                           max_buffer_size=4 * MAX_BODY_BYTES)
    sockets = tornado.netutil.bind_sockets(port, host)
    server.add_sockets(sockets)
    real_port = sockets[0].getsockname()[1]
    url = f"{'https' if ssl_ctx else 'http'}://{host}:{real_port}"
    write_private_json(home / "server.json", {**({"ca": str(Path(ca).resolve())} if ca else {}),
        "url": url, "token": token, "user": user, "agent_token": agent_token, "pid": os.getpid(),
    })
    log.info("serving on %s (home %s)", url, home)
    agent_pids = start_local_agents(home, url, store, nodes, devices_per_node, store_url,
                                    str(Path(ca).resolve()) if ca else None, stop_timeout,
                                    config.node_timeout_s) if nodes else []
    ray_placer, ray_task = None, None
    if ray_address:  # Ray is imported only on this path (an optional extra)
        from backend.ray_cluster.loop import keep_agents
        from backend.ray_cluster.placer import RayPlacer

        ray_placer = RayPlacer(ray_address, url, store_url, str(Path(ca).resolve()) if ca else None,
                               placed_on=service.ray_node_ids)
        await asyncio.to_thread(ray_placer.connect)
        ray_task = asyncio.create_task(keep_agents(ray_placer, lambda name: store.issue_token(node_user(name), NODE_ROLE),
                                                   lambda name: service.drain(ADMIN_ROLE, name)))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_nodes() -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                service.check_nodes()
                service.check_moves()
            except Exception:
                log.exception("node check failed")

    # A restarted server gives every node a full node timeout to reconnect: its silence is
    # counted from now, not from the last heartbeat the previous server recorded.
    with store.tx():
        for n in store.nodes():
            if n.state not in (NodeState.LOST, NodeState.DOWN):
                store.set_node(n.name, heartbeat_at=max(n.heartbeat_at or 0.0, time.time()))
    watcher = asyncio.create_task(watch_nodes())
    service.schedule_now()
    await stop.wait()
    log.info("shutting down: jobs checkpoint and stop (at most %.0f s), to resume when the service is back",
             stop_timeout)
    with store.tx():  # nothing more is placed: the nodes' next hellos make them ready again
        for n in store.nodes():
            if n.state == NodeState.READY:
                store.set_node(n.name, state=NodeState.DOWN.value)
    for link in list(service.links.values()):
        try:
            link.send(Shutdown(reason="server stopping"))
        except Exception:
            pass
    # A planned stop: the agents checkpoint their jobs, which go back to the queue; the server
    # keeps answering until they have said so and left (or the bound passes).
    deadline = time.monotonic() + stop_timeout + 10.0
    while service.links and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    watcher.cancel()
    server.stop()
    await asyncio.sleep(0.1)
    if ray_placer is not None:
        ray_task.cancel()
        await asyncio.to_thread(ray_placer.close)
    if agent_pids:
        await asyncio.to_thread(stop_local_agents, home, agent_pids, stop_timeout + 10.0)
    (home / "server.json").unlink(missing_ok=True)
    store.close()


def _login_name() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "default"


def run(home: Optional[Path], host: str, port: int, nodes: int, devices_per_node: Optional[int],
        store: Optional[str] = None, checkpoint_every: Optional[float] = None,
        node_timeout: float = ServiceConfig.node_timeout_s, policy: str = ServiceConfig.policy,
        min_move_interval: float = ServiceConfig.min_move_interval_s,
        move_cost: float = ServiceConfig.move_cost_s,
        checkpoint_timeout: float = ServiceConfig.checkpoint_timeout_s, tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None, ca: Optional[str] = None, ray_address: Optional[str] = None,
        stop_timeout: float = 30.0, run_as: Optional[Path] = None) -> None:
    home = Path(home) if home else default_home()
    if checkpoint_every is None:  # not given: the cluster default; 0 turns periodic checkpoints off
        checkpoint_every = ServiceConfig.checkpoint_every
    elif checkpoint_every <= 0:
        checkpoint_every = None
    logging.basicConfig(level=os.environ.get(ENV_LOG_LEVEL, "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServiceConfig(checkpoint_every=checkpoint_every, node_timeout_s=node_timeout, policy=policy,
                           min_move_interval_s=min_move_interval, move_cost_s=move_cost,
                           checkpoint_timeout_s=checkpoint_timeout,
                           run_as=read_table(run_as) if run_as is not None else None)
    asyncio.run(serve(home, host, port, nodes, devices_per_node, config, store, tls_cert, tls_key, ca, ray_address,
                      stop_timeout))
