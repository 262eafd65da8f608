"""Warm worker processes: the agent's asyncio client of the fork server (`backend.forkserver`).

A fresh worker pays for its interpreter and for ``import torch`` and DDP's lazy imports (1-2 s):
on a resize or a restore that is most of the time a job stands still. The agent keeps one fork
server (*zygote*) per node, started for the target ``backend.worker.main``, that imported all
of it once; a worker is a ``fork()`` of it (tens of milliseconds), in its own session, with the
pipes, working directory, environment and umask a fresh ``python -m backend.worker`` would
have had (`backend.forkserver` owns the server, the wire format and the child's setup).
Until the zygote is ready, or if it dies, `Spawner.spawn` returns None and the agent starts a
fresh interpreter.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from typing import Any, Optional

from backend import forkserver

from .sandbox import JOB_UMASK_ENV, SECRET_ENV

log = logging.getLogger("singularity.agent")

#: what the zygote forks
TARGET = "backend.worker.main"

class WarmProcess:
    """A forked worker, with the parts of ``asyncio.subprocess.Process`` the agent uses."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader,
                 stderr: asyncio.StreamReader, exited: "asyncio.Future[int]") -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._exited = exited

    @property
    def returncode(self) -> Optional[int]:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class Spawner:
    """The agent's handle on its zygote. `start()` warms it in the background; until it is
    ready (or if it dies) `spawn` returns None and the caller starts a fresh interpreter."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = None
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._ready = False
        self._next = 0
        self._pids: dict[str, asyncio.Future[int]] = {}
        self._exits: dict[str, asyncio.Future[int]] = {}
        self._listener: Optional[asyncio.Task] = None  # held so the reading task is not collected

    async def start(self) -> None:
        # A fork's /proc/self/environ is the zygote's first environment: no credential in it.
        clean = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        mine, theirs, command, env = forkserver.server_process([TARGET], env=clean, with_parent=True)
        self._sock = mine
        self._proc = await asyncio.create_subprocess_exec(
            *command, pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, env=env)
        theirs.close()
        mine.setblocking(False)
        self._listener = asyncio.create_task(self._read(mine))

    async def _read(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    packet = await loop.sock_recv(sock, 65536)
                except OSError:
                    break
                if not packet:
                    break
                msg = json.loads(packet)
                if msg.get("ready"):
                    self._ready = True
                elif "pid" in msg:
                    if msg["pid"] < 0:  # refused: no exit will be reported
                        log.warning("the spawner refused a worker: %s", msg.get("error"))
                        self._settle(self._exits, msg["id"], -signal.SIGKILL)
                    self._settle(self._pids, msg["id"], msg["pid"])
                else:
                    self._settle(self._exits, msg["id"], msg["rc"])
        finally:
            self._ready = False
            log.warning("the warm worker spawner stopped; workers start as fresh processes from now on")
            for futures in (self._pids, self._exits):
                for rid in list(futures):
                    self._settle(futures, rid, -signal.SIGKILL)  # its children died with it

    @staticmethod
    def _settle(futures: dict[str, "asyncio.Future[int]"], rid: str, value: int) -> None:
        fut = futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    @property
    def ready(self) -> bool:
        return self._ready

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, control_fd: int,
                    limit: int, sandbox: Optional[dict[str, Any]] = None) -> Optional[WarmProcess]:
        """Fork a worker (``python -m backend.worker ARGV`` as it would have run), or None; in
        ``sandbox`` (``{"mounts", "account"}``, see `backend.namespaces`) if given."""
        if not self._ready or self._sock is None:
            return None
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._next += 1
        rid = str(self._next)
        forked = self._pids[rid] = loop.create_future()
        exited = self._exits[rid] = loop.create_future()
        try:
            forkserver.send_request(self._sock, rid, TARGET, argv, env, cwd, [in_r, out_w, err_w, control_fd],
                                    umask=_umask(env), sandbox=sandbox)
        except OSError as exc:
            log.warning("could not hand a worker to the spawner (%s); starting a fresh process", exc)
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            self._pids.pop(rid, None)
            self._exits.pop(rid, None)
            return None
        finally:
            for fd in (in_r, out_w, err_w):  # the child has its copies
                os.close(fd)
        pid = await forked
        if pid < 0:  # the spawner died (or refused) before forking it: start a fresh one instead
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            return None
        stdout = await _reader(out_r, limit)
        stderr = await _reader(err_r, limit)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            os.fdopen(in_w, "wb", buffering=0))
        stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        return WarmProcess(pid, stdin, stdout, stderr, exited)

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.returncode is None:
            # it holds nothing but imports (and may still be importing torch, deaf to the socket)
            self._proc.kill()
            await self._proc.wait()


def _umask(env: dict[str, str]) -> int:
    """The job's umask (not the service's 077), as ``sandbox.job_umask`` reads it from ``env``."""
    try:
        return int(env.get(JOB_UMASK_ENV, "022"), 8)
    except ValueError:
        return 0o022


async def _reader(fd: int, limit: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
    return reader

