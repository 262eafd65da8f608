"""Warm worker processes: fork them from a process that has already imported torch.

A fresh worker pays for its interpreter and for ``import torch`` (0.8 s here), and a
data-parallel rank also for what DDP's constructor imports lazily (``torch._dynamo``, another
0.8 s): on a resize or a restore that is most of the time a job stands still. The agent keeps
one *zygote* process per node that imported all of it once; a worker is a ``fork()`` of it
(tens of milliseconds), in its own session, with the pipes and environment a fresh one would
have had. The zygote never runs user code, starts no threads and initialises no device, so a
fork of it is as clean as a fresh interpreter; RNGs that seed themselves from the OS at import
are seeded again in each child.

Wire format (a Unix socket pair): the agent sends one JSON line per request with its four
descriptors (stdin, stdout, stderr, control) attached (SCM_RIGHTS); the zygote answers
``{"id", "pid"}`` once forked and ``{"id", "rc"}`` when the child exits (``rc`` as
``Popen.returncode``: negative for a signal).
"""
from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, Optional

from backend.contract import ENV_CONTROL_FD

from .sandbox import JOB_UMASK_ENV

log = logging.getLogger("singularity.agent")

#: what a worker may need, imported once by the zygote (missing ones are skipped)
PRELOAD = ("backend.worker.main", "backend.proxy", "backend.proxy.distributed.collectives", "backend.proxy.distributed.cut",
           "cloudpickle", "numpy", "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
FDS_PER_REQUEST = 4
CONTROL_FD = 3  # where the child finds its control pipe (SINGULARITY_CONTROL_FD)


# ---------------------------------------------------------------------------- the zygote side
def _recv(sock: socket.socket) -> tuple[Optional[dict[str, Any]], list[int]]:
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(1 << 20, socket.CMSG_SPACE(FDS_PER_REQUEST * fds.itemsize))
    if not msg:
        return None, []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return json.loads(msg), list(fds)


def _child(request: dict[str, Any], fds: list[int], sock_fd: int) -> None:
    """In the forked child: become the worker a fresh ``python -m backend.worker`` would be."""
    rc = 1
    try:
        if sock_fd not in fds:
            os.close(sock_fd)  # the user's code must not reach the zygote's socket
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2, CONTROL_FD), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > CONTROL_FD:
                os.close(fd)
        os.chdir(request["cwd"])
        os.umask(int(request["env"].get(JOB_UMASK_ENV, "022"), 8))  # not the service's 077
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[ENV_CONTROL_FD] = str(CONTROL_FD)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _like_a_fresh_interpreter(request["cwd"], request["env"])
        sys.argv = ["backend.worker", *request["argv"]]
        from backend.worker.main import main

        try:
            rc = main(request["argv"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(rc)


def _like_a_fresh_interpreter(cwd: str, env: dict[str, str]) -> None:
    """What the zygote fixed at import time and a fresh worker would have chosen itself."""
    sys.path[0] = cwd  # ``python -m`` puts the working directory first
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if "numpy.random" in sys.modules:  # seeded from the OS at import: every child would agree
        sys.modules["numpy.random"].seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        # OpenMP read the zygote's environment when torch loaded; intra-op thread counts change
        # float results, so the worker's own count must apply.
        threads = env.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)


def serve(fd: int) -> None:
    """The zygote's loop: fork a child per request, report pids and exit codes."""
    from backend.worker.main import die_with_parent

    die_with_parent()  # the agent's death takes the zygote along, and its workers with it
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A CUDA context does not survive fork(): children could not use their device.
        print("spawner: CUDA was initialised while preloading; not forking workers", file=sys.stderr)
        return
    import select

    from backend.proxy.launch import report_exits

    sock = socket.socket(fileno=fd)

    def say(msg: dict[str, Any]) -> None:
        sock.sendall((json.dumps(msg) + "\n").encode())

    running: dict[int, str] = {}
    say({"ready": True})
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02 if running else 1.0)
        if ready:
            request, fds = _recv(sock)
            if request is None:
                return  # the agent closed its end
            pid = os.fork()
            if pid == 0:
                _child(request, fds, fd)
            for f in fds:
                os.close(f)
            running[pid] = request["id"]
            say({"id": request["id"], "pid": pid})
        report_exits(running, say)


# ---------------------------------------------------------------------------- the agent side
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
        # Datagram-like packets: one request and its descriptors per packet, never merged or split.
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self._sock = mine
        # The zygote computes nothing, and must not initialise CUDA (fork would break it in the
        # children): torch's availability checks then ask NVML instead of the CUDA runtime.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "backend.agent.spawner", str(theirs.fileno()),
            pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, env=env)
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
                    limit: int) -> Optional[WarmProcess]:
        """Fork a worker (``python -m backend.worker ARGV`` as it would have run), or None."""
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
        payload = json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd}).encode()
        fds = array.array("i", [in_r, out_w, err_w, control_fd])
        try:
            self._sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
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
        if pid < 0:  # the spawner died before forking it: start a fresh one instead
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


async def _reader(fd: int, limit: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
    return reader


if __name__ == "__main__":
    serve(int(sys.argv[1]))
