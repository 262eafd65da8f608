"""The node agent: owns a node's devices, starts and stops workers, reports what happens.

It keeps one WebSocket to the server. When the server goes away, workers keep running and
events pile up in the outbox; on reconnect the agent says hello (with the jobs it still has),
the server answers with the last sequence number it committed, and the rest is replayed.
Workers run on a lease: when the agent has heard nothing from the server (no message, no answer
to its pings) for longer than ``lease`` seconds, its jobs checkpoint at their next safe point and
stop, as in a planned stop, and resume from that checkpoint once the server hears of it. And the
agent on one of its own: it tells each worker every second that it is alive, and a worker that
has not heard it for `worker_lease` seconds ends itself (a frozen agent cannot stop it, and the
server has lost the node and placed the job elsewhere long before).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect

from singularity_sdk.protocol import (
    API_PREFIX,
    Ack,
    AgentEvents,
    AgentHeartbeat,
    AgentHello,
    AgentLeaving,
    CheckpointJob,
    DeviceInfo,
    EventType,
    PrefetchCheckpoint,
    Shutdown,
    StartJob,
    StopJob,
    Welcome,
    server_message_adapter,
)

from backend import contract
from backend.contract import ENV_LOG_LEVEL
from backend.proxy.checkpoint.fingerprint import node as node_fingerprint
from backend.proxy.checkpoint.store import CheckpointStore, committed_step
from singularity_sdk import tls
from singularity_sdk.config import default_home

from . import accounts, sandbox
from .credential import obtain as obtain_credential
from .outbox import Outbox
from .prefetch import PREFETCH_ENV, Prefetcher
from .spawner import Spawner
from .transfer import CheckpointTransfer
from .workers import JobRun

log = logging.getLogger("singularity.agent")
WARM_ENV = "SINGULARITY_WARM_WORKERS"


#: how long the agent waits for the server to acknowledge a batch before sending the next anyway
ACK_WAIT_S = 1.0


class Agent:
    def __init__(self, server: str, token: str, name: str, devices: list[DeviceInfo], home: Path,
                 checkpoint_root: Path, threads_per_slot: int = 1, orphan_timeout: Optional[float] = None,
                 store: Optional[str] = None, address: Optional[str] = None, ca: Optional[str] = None,
                 stop_timeout: float = 30.0, lease: Optional[float] = None):
        self.url = server.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + API_PREFIX + "/agents/ws"
        self.token = token
        #: trusts the server's private CA when it serves TLS (--ca / SINGULARITY_CA)
        self.ssl = tls.context(ca)
        self.name = name
        self.devices = devices
        self.home = home
        self.checkpoint_root = checkpoint_root
        self.threads_per_slot = threads_per_slot
        self.orphan_timeout = orphan_timeout
        #: after this many seconds without hearing from the server, jobs checkpoint and stop
        #: (None: they run on until the server is back or the orphan timeout)
        self.lease = lease if lease and lease > 0 else None
        #: a planned stop waits this long for its jobs to checkpoint (see `_wind_down`)
        self.stop_timeout = stop_timeout
        self._stop_reason = "the node agent is stopping"
        self.address = address
        self.transfer = CheckpointTransfer(store, checkpoint_root) if store else None
        #: job -> the copy of its checkpoint being made here while it migrates here (`PrefetchCheckpoint`)
        self.prefetches: dict[str, Prefetcher] = {}
        self.instance = uuid.uuid4().hex
        #: sandbox each worker (backend/agent/sandbox.py); why not, when it was required and cannot be
        self.bwrap: Optional[str] = None
        self.sandbox_refusal: Optional[str] = None
        try:
            self.bwrap = sandbox.choose()
        except sandbox.SandboxUnavailable as exc:
            self.sandbox_refusal = str(exc)
        #: what a sandboxed worker must not see: the service's home, this agent's, the checkpoints
        self.hidden = tuple({default_home(), home, checkpoint_root,
                             *([home.parent.parent] if home.parent.name == "agents" else [])})
        #: forks workers from a process that already imported torch (SINGULARITY_WARM_WORKERS=0: off);
        #: a fork makes its own sandbox (backend/namespaces.py) where the kernel lets it, else a
        #: sandboxed worker starts fresh under bwrap
        warm = os.environ.get(WARM_ENV, "1") != "0" and self.sandbox_refusal is None
        if warm and self.bwrap is not None and (why := sandbox.forks_can_sandbox()) is not None:
            log.warning("sandboxed workers start as fresh interpreters (1-2 s each): a fork of the warm spawner "
                        "cannot make its own sandbox here: %s", why)
            warm = False
        self.spawner: Optional[Spawner] = Spawner() if warm else None
        self.outbox = Outbox()
        self.runs: dict[str, JobRun] = {}
        self.heartbeat_s = 1.0
        self._wake = asyncio.Event()
        self._acked = asyncio.Event()
        self._stop = asyncio.Event()
        self._ws: Optional[ClientConnection] = None
        #: when the server last answered (any message, or a pong to a ping)
        self._last_heard = time.time()

    # ------------------------------------------------------------------ events out

    def emit_for(self, run: JobRun):
        def emit(type: EventType, data: dict[str, Any]) -> None:
            self.outbox.add(run.spec.job_id, run.spec.attempt, type, data)
            self._wake.set()
        return emit

    def known_jobs(self) -> list[tuple[str, int]]:
        alive = {run.key for run in self.runs.values() if not run.done.is_set()}
        return sorted(alive | self.outbox.jobs())

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if self.spawner is not None:
            try:
                await self.spawner.start()  # warms up in the background; workers start cold until then
            except OSError as exc:
                log.warning("no warm worker spawner (%s); every worker starts a fresh interpreter", exc)
                self.spawner = None
        backoff = 0.1
        stopper = asyncio.create_task(self._wind_down())
        lease_watch = asyncio.create_task(self._watch_lease()) if self.lease is not None else None
        keep_alive = asyncio.create_task(self._tell_workers_alive())
        while not stopper.done():
            try:
                async with connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                                   **tls.websocket_kwargs(self.url, self.ssl),
                                   max_size=64 * 1024 * 1024, open_timeout=5, ping_interval=10) as ws:
                    backoff = 0.1
                    await self._session(ws, stopper)
            except (OSError, websockets.exceptions.WebSocketException, asyncio.TimeoutError) as exc:
                if isinstance(exc, websockets.exceptions.InvalidStatus) and exc.response.status_code in (401, 403):
                    log.error("the server refused this node's credential (%s); check --token-file, or remove "
                              "'credential' from the agent's home to enroll again", exc.response.status_code)
                    break
                log.info("server unreachable (%s); retrying in %.1fs", type(exc).__name__, backoff)
            self._ws = None
            if self.orphan_timeout is not None and time.time() - self._last_heard > self.orphan_timeout \
                    and not self._stop.is_set():
                log.warning("no server for %.0fs: jobs checkpoint and stop, and the agent exits", self.orphan_timeout)
                self._stop_reason = f"the node agent had no server for {self.orphan_timeout:g} s"
                self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(stopper), backoff)
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, 2.0)
        if lease_watch is not None:
            lease_watch.cancel()
        keep_alive.cancel()
        await self.shutdown()

    async def _session(self, ws: ClientConnection, stopper: asyncio.Task) -> None:
        # Unless told otherwise, other nodes reach this one at the address it reaches the server from.
        address = self.address or (ws.local_address[0] if ws.local_address else None)
        hello = AgentHello(node=self.name, instance=self.instance, devices=self.devices,
                           known_jobs=self.known_jobs(), address=address, fingerprint=node_fingerprint(self.devices))
        await ws.send(hello.model_dump_json())
        welcome = Welcome.model_validate_json(await ws.recv())
        self.heartbeat_s = welcome.heartbeat_s
        self.outbox.connected(welcome.acked_seq)
        self._ws = ws
        self._last_heard = time.time()
        log.info("connected to %s as %s; replaying %d buffered events", self.url, self.name, len(self.outbox))
        tasks = [asyncio.create_task(self._sender(ws)), asyncio.create_task(self._receiver(ws)),
                 asyncio.create_task(self._heartbeats(ws))]
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            if t is not stopper and t.exception() is not None:
                raise t.exception()

    async def _sender(self, ws: ClientConnection) -> None:
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self.outbox.take_unsent():
                await ws.send(AgentEvents(events=batch).model_dump_json())
                await self._until_acked(batch[-1].agent_seq)

    async def _until_acked(self, seq: int) -> None:
        """One batch in flight: while the server commits it, new lines join the unsent events
        (Outbox.add), so a busy server gets fewer, larger batches instead of a queue of small
        ones in its socket (an idle one acks within a millisecond). An ack that does not come
        within ``ACK_WAIT_S`` (the batch was refused whole) stops holding the next one back."""
        deadline = time.monotonic() + ACK_WAIT_S
        while self.outbox.acked < seq and (left := deadline - time.monotonic()) > 0:
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), left)
            except (asyncio.TimeoutError, TimeoutError):
                return

    async def _heartbeats(self, ws: ClientConnection) -> None:
        while True:
            await ws.send(AgentHeartbeat(time=time.time(), running=self.known_jobs()).model_dump_json())
            # A sent heartbeat proves nothing (a stopped or partitioned server's socket takes it):
            # the server's pong does, and keeps the lease.
            pong = await ws.ping()
            pong.add_done_callback(self._pong)
            await asyncio.sleep(self.heartbeat_s)

    def _pong(self, pong: "asyncio.Future[float]") -> None:
        if not pong.cancelled() and pong.exception() is None:
            self._last_heard = max(self._last_heard, time.time())

    async def _watch_lease(self) -> None:
        """Workers run on a lease: once the server has been silent for longer than ``lease``, every
        job here checkpoints at its next safe point and stops (a planned stop: the exit and the
        checkpoint wait in the outbox), so it resumes from there, not from an older checkpoint,
        once the server is back; the agent itself stays and keeps trying to reconnect."""
        assert self.lease is not None
        while True:
            await asyncio.sleep(min(0.25, self.lease / 4))
            silent = time.time() - self._last_heard
            if silent <= self.lease:
                continue
            runs = [r for r in self.runs.values()
                    if not r.done.is_set() and r.planned_stop is None and r.stopping is None]
            if not runs:
                continue
            reason = f"the node agent has not heard from the server for {silent:.0f} s (lease {self.lease:g} s)"
            log.warning("%s: %d job(s) checkpoint and stop", reason, len(runs))
            # the bound of a planned stop; 30 s where that is 0 ("the home goes with the agent,
            # do not bother": a temporary LocalCluster), since this checkpoint is what the job
            # resumes from
            bound = self.stop_timeout if self.stop_timeout > 0 else 30.0
            for r in runs:
                asyncio.create_task(r.stop_at_checkpoint(reason, bound))

    @property
    def worker_lease(self) -> float:
        """How long a worker runs on without a word from this agent: twice the agent's own lease
        (at least 10 s, so a loaded machine's slow event loop does not end healthy workers)."""
        return max(10.0, 2 * (self.lease or 10.0))

    async def _tell_workers_alive(self) -> None:
        while True:
            await asyncio.sleep(contract.AGENT_PING_S)
            for run in list(self.runs.values()):
                if not run.done.is_set():
                    run.send_control({"op": contract.OP_ALIVE})

    async def _receiver(self, ws: ClientConnection) -> None:
        async for raw in ws:
            self._last_heard = time.time()
            try:
                msg = server_message_adapter.validate_json(raw)
            except ValidationError as exc:
                data = json.loads(raw) if raw else {}
                if isinstance(data, dict) and data.get("type") == "start":
                    self._refuse_start(data, f"the node refused the job's start message: {exc.errors()[0]['msg']}")
                else:
                    log.warning("server says: %s", data.get("error", raw) if isinstance(data, dict) else raw)
                continue
            if isinstance(msg, Ack):
                self.outbox.ack(msg.agent_seq)
                self._acked.set()
            elif isinstance(msg, StartJob):
                await self._start(msg)
            elif isinstance(msg, StopJob):
                asyncio.create_task(self._stop_job(msg))
            elif isinstance(msg, CheckpointJob):
                run = self.runs.get(msg.job_id)
                if run and run.spec.attempt == msg.attempt:
                    run.send_control({"op": "checkpoint", "then": msg.then, "reason": msg.reason,
                                      "timeout_s": msg.timeout_s})
            elif isinstance(msg, PrefetchCheckpoint) and msg.cancel:
                prefetch = self.prefetches.get(msg.job_id)
                if prefetch is not None and prefetch.attempt == msg.attempt:
                    log.info("%s will not start here after all: its prefetched checkpoint is dropped", msg.job_id)
                    del self.prefetches[msg.job_id]
                    asyncio.create_task(asyncio.to_thread(prefetch.stop))
            elif isinstance(msg, PrefetchCheckpoint):
                if self.transfer is not None and msg.job_id not in self.runs and os.environ.get(PREFETCH_ENV) != "0":
                    if (old := self.prefetches.pop(msg.job_id, None)) is not None:  # an earlier move's
                        asyncio.create_task(asyncio.to_thread(old.stop))
                    self.prefetches[msg.job_id] = Prefetcher(self.transfer, msg.job_id, msg.attempt).start()
            elif isinstance(msg, Shutdown):
                log.info("server asked us to stop: %s", msg.reason)
                self._stop_reason = f"the node agent is stopping ({msg.reason})"
                self._stop.set()

    # ------------------------------------------------------------------ jobs

    def _refuse_start(self, data: dict[str, Any], why: str) -> None:
        """Report every rank of a start this node will not run as failed, so the job ends at
        once with the reason instead of holding its devices forever."""
        log.error("refusing to start %s: %s", data.get("job_id"), why)
        job_id, attempt = data.get("job_id"), data.get("attempt")
        if not isinstance(job_id, str) or type(attempt) is not int:
            return
        for rs in data.get("ranks") or [{"rank": 0}]:
            rank = rs.get("rank") if isinstance(rs, dict) else 0
            self.outbox.add(job_id, attempt, EventType.WORKER_EXITED,
                            {"rank": rank if type(rank) is int else 0, "code": 1, "error": why, "user_error": True})
        self._wake.set()

    async def _start(self, spec: StartJob) -> None:
        if self.sandbox_refusal is not None:
            self._refuse_start(spec.model_dump(), self.sandbox_refusal)
            return
        if spec.run_as is not None and (why := accounts.refusal(spec.run_as, self.bwrap is not None)):
            self._refuse_start(spec.model_dump(), why)
            return
        old = self.runs.get(spec.job_id)
        if old is not None:
            if old.spec.attempt == spec.attempt:
                return  # a duplicate start: already running
            await old.stop("superseded by a newer attempt", 1.0)
        announce = spec.master_port == 0 and len(spec.ranks) < spec.world_size
        if spec.master_port == 0:  # rank 0 is here: its rendezvous listens on a port free on this node
            spec = spec.model_copy(update={"master_port": free_port()})
        run_dir = self.home / "jobs" / f"{spec.job_id}-a{spec.attempt}"
        run = JobRun(spec, run_dir, self.devices, self.threads_per_slot, self.checkpoint_root, emit=None,  # type: ignore[arg-type]
                     on_checkpoint=self._store_checkpoint if self.transfer else None, spawner=self.spawner,
                     bwrap=self.bwrap, hidden=self.hidden,
                     account=accounts.lookup(spec.run_as) if spec.run_as is not None else None,
                     agent_lease_s=self.worker_lease)
        run.emit = self.emit_for(run)
        self.runs[spec.job_id] = run
        if announce:  # the other nodes' ranks start once the server knows the port
            run.emit(EventType.RENDEZVOUS, {"port": spec.master_port})
        try:
            if self.transfer is not None:
                await asyncio.to_thread(self.transfer.fence, spec.job_id, spec.attempt)
                t0, prefetch = time.monotonic(), self.prefetches.pop(spec.job_id, None)
                if prefetch is not None and not spec.restore:  # nothing to restore after all
                    await asyncio.to_thread(prefetch.stop)
                elif spec.restore:
                    early = await asyncio.to_thread(prefetch.finish) if prefetch is not None else {}
                    linked = await asyncio.to_thread(self.transfer.download, spec.job_id, upto=spec.restore_step)
                    run.fetched = {"fetch_s": round(time.monotonic() - t0, 3),
                                   "prefetched_bytes": sum(early.values()),
                                   "linked_bytes": linked + (prefetch.linked_bytes if prefetch is not None else 0)}
            if spec.restore and spec.restore_step is not None:
                gone = CheckpointStore(self.checkpoint_root / spec.job_id).discard_after(spec.restore_step)
                if gone:
                    log.info("%s: removed checkpoint(s) the server never heard of: %s", spec.job_id,
                             ", ".join(p.name for p in gone))
            exchange = None
            if self.transfer is not None and len(spec.ranks) < spec.world_size:  # its parts meet in the store
                exchange = self.transfer.exchange(spec.job_id, spec.attempt, spec.world_size, [r.rank for r in spec.ranks])
            await run.start()
            if exchange is not None:
                asyncio.create_task(exchange.run(run.done))
            if self.transfer is not None and any(r.rank == 0 for r in spec.ranks):  # checkpoints commit here
                asyncio.create_task(self.transfer.stream(spec.job_id, spec.attempt).run(run.done))
        except Exception as exc:  # cannot even spawn: report as a failed rank so the job ends
            log.exception("could not start %s", spec.job_id)
            for rs in spec.ranks:
                run.emit(EventType.WORKER_EXITED, {"rank": rs.rank, "code": -1, "error": f"could not start the worker: {exc}"})
            run.done.set()
            return
        asyncio.create_task(self._cleanup_when_done(run))

    async def _store_checkpoint(self, run: JobRun, data: dict[str, Any]) -> dict[str, Any]:
        """Upload a committed checkpoint before reporting it, so the server only ever hears
        of checkpoints that every node can restore."""
        assert self.transfer is not None
        t0 = time.monotonic()
        spec = run.spec
        up = await asyncio.to_thread(self.transfer.upload, spec.job_id, spec.attempt, Path(data["path"]), False)
        # begins once the report is out (it is emitted before this task runs): what the upload
        # supersedes in the store is removed while the job moves on
        asyncio.create_task(asyncio.to_thread(self.transfer.tidy, spec.job_id, spec.attempt,
                                              committed_step(Path(data["path"]).name)))
        return {"store_path": up.path, "upload_s": round(time.monotonic() - t0, 3), "upload_bytes": up.sent_bytes,
                "reused_bytes": up.reused_bytes}

    async def _cleanup_when_done(self, run: JobRun) -> None:
        await run.done.wait()
        if self.runs.get(run.spec.job_id) is run:
            del self.runs[run.spec.job_id]
        # off the event loop: twenty jobs ending together held every node's output for ~10 ms each
        await asyncio.to_thread(shutil.rmtree, run.run_dir, ignore_errors=True)
        # checkpoints the worker pruned just before it exited (a preemption's commit does not wait
        # for their removal: docs/checkpoint-format.md)
        await asyncio.to_thread(CheckpointStore(self.checkpoint_root / run.spec.job_id).remove_pruned)

    async def _stop_job(self, msg: StopJob) -> None:
        run = self.runs.get(msg.job_id)
        if run is None or run.spec.attempt != msg.attempt:
            return
        await run.stop(msg.reason, msg.grace_s)

    async def _wind_down(self) -> None:
        """A planned stop (SIGTERM or SIGINT to the agent, or the server's Shutdown): every job
        here checkpoints at its next safe point and exits, and the server queues it again, so it
        resumes where it stopped (elsewhere, or here once the agent is back); a job that reaches
        no safe point within ``stop_timeout`` is ended. The connection stays open meanwhile, so
        the server hears of every checkpoint and exit before this agent goes."""
        await self._stop.wait()
        if self._ws is not None:
            try:
                await self._ws.send(AgentLeaving(reason=self._stop_reason).model_dump_json())
            except Exception:  # the connection is going: the jobs stop all the same
                pass
        runs = [r for r in self.runs.values() if not r.done.is_set()]
        if runs and self.stop_timeout <= 0:
            await asyncio.gather(*(r.stop(self._stop_reason, 1.0) for r in runs), return_exceptions=True)
        elif runs:
            log.info("planned stop: %d job(s) checkpoint and stop (at most %.0f s)", len(runs), self.stop_timeout)
            await asyncio.gather(*(r.stop_at_checkpoint(self._stop_reason, self.stop_timeout) for r in runs),
                                 return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while self._ws is not None and len(self.outbox) and loop.time() < deadline:
            self._wake.set()
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        for prefetch in self.prefetches.values():
            await asyncio.to_thread(prefetch.stop)
        runs = list(self.runs.values())
        await asyncio.gather(*(r.stop("agent shutting down", 1.0) for r in runs), return_exceptions=True)
        # Give the final exit events a moment to reach the server.
        if self._ws is not None and len(self.outbox):
            self._wake.set()
            await asyncio.sleep(0.2)
        if self.spawner is not None:
            await self.spawner.close()
        log.info("agent %s stopped", self.name)


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    from singularity_sdk.config import default_home

    from .devices import discover

    p = argparse.ArgumentParser(prog="singularityctl agent", description="Run a node agent.")
    p.add_argument("--server", required=True, help="server URL, e.g. http://127.0.0.1:8765")
    p.add_argument("--token-file", type=Path, default=None,
                   help="a file (mode 0600) holding this node's credential; default: 'credential' in --home, "
                        "or SINGULARITY_AGENT_TOKEN. Without one the agent enrolls with the join token "
                        "(SINGULARITY_JOIN_TOKEN, or --join-token-file) and keeps its credential in --home")
    p.add_argument("--ca", default=os.environ.get(tls.CA_ENV) or None, metavar="PEM",
                   help="the CA that signed the server's TLS certificate (default: SINGULARITY_CA, else the "
                        "system's trust store)")
    p.add_argument("--join-token-file", type=Path, default=None,
                   help="a file holding the join token (agent_token in the server's server.json)")
    p.add_argument("--name", default=os.uname().nodename.split(".")[0])
    p.add_argument("--devices", type=int, default=None, help="CPU slots to offer where there is no GPU (or a GPU limit)")
    p.add_argument("--home", type=Path, default=None, help="work directory for this agent's jobs")
    p.add_argument("--checkpoint-root", type=Path, default=None)
    p.add_argument("--threads-per-slot", type=int, default=1)
    p.add_argument("--orphan-timeout", type=float, default=None,
                   help="exit after this many seconds without a server (its jobs checkpoint and stop first)")
    p.add_argument("--lease", type=float, default=10.0, metavar="SECONDS",
                   help="after this many seconds without hearing from the server, jobs checkpoint and stop, "
                        "to resume from there once the server is back (default 10, the server's default "
                        "--node-timeout: keep it at most that; 0: never)")
    p.add_argument("--stop-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long jobs have to checkpoint before they are ended (default 30)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="checkpoint store shared by all nodes (fsspec URL: file://, s3://, gs://, az://); "
                        "without it, --checkpoint-root must be a folder every node sees")
    p.add_argument("--address", default=os.environ.get("SINGULARITY_AGENT_ADDRESS") or None,
                   help="how the other nodes reach this one (rank 0 of a job listens here); "
                        "default: the local address of the connection to the server")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get(ENV_LOG_LEVEL, "INFO"),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    base = default_home()
    home = args.home or base / "agents" / args.name
    try:
        token = obtain_credential(args.server, args.name, home, args.token_file, args.join_token_file,
                                  tls.context(args.ca) or True)
    except RuntimeError as exc:
        raise SystemExit(f"singularityctl agent: {exc}") from None
    agent = Agent(args.server, token, args.name, discover(args.devices), home,
                  args.checkpoint_root or base / "checkpoints", args.threads_per_slot, args.orphan_timeout,
                  args.store, args.address, args.ca, args.stop_timeout, args.lease)
    asyncio.run(agent.run())


def free_port() -> int:
    """A TCP port free on every interface of this node now (the kernel's choice, as torchrun
    makes it): the job's rendezvous store binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
