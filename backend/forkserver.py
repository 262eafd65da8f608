"""The fork server: a process that imported torch once and forks a child per request.

A fresh interpreter pays for itself and for ``import torch`` (0.8 s here), and a data-parallel
rank also for what DDP's constructor imports lazily (``torch._dynamo``, another 0.8 s): on a
resize or a restore that is most of the time a job stands still, and the tests start dozens of
runs. A fork server (a "zygote") imported all of it once; a run is a ``fork()`` of it (tens
of milliseconds), in its own session, with the descriptors, working directory, environment,
umask, thread count and RNG seeds a fresh ``python -m TARGET ARGV`` would have had. The server
never runs user code, starts no threads and initialises no device, so a fork of it is as clean
as a fresh interpreter. Every run is still its own process.

What a child runs is a *target*: the ``main(argv) -> int`` of one of the modules in `TARGETS`,
a fixed registry (a request names one; no code travels in a request). The agent forks workers
(``backend.worker.main``), the local multi-rank launcher forks ranks (``backend.proxy.launch``)
and the proxy's tests fork CLI runs (``backend.proxy.__main__``). A server is started as
``python -m backend.forkserver FD [--die-with-parent] TARGET...``: it imports those targets and
what they need, then serves requests for any target of the registry until the client closes its
end of the socket.

Wire format (a ``SOCK_SEQPACKET`` Unix socket pair, one message per packet): the client sends
``{"id", "target", "argv", "env", "cwd"[, "umask"][, "sandbox"]}`` with three or four descriptors attached
(SCM_RIGHTS): the child's stdin, stdout, stderr and, if given, a control pipe it finds at fd 3
(``SINGULARITY_CONTROL_FD``). ``env`` is the child's whole environment. The server answers
``{"ready": true}`` once its imports are done, ``{"id", "pid"}`` once it forked (``pid`` -1 and
an ``error`` if it refused), and ``{"id", "rc"}`` when the child exits (``rc`` as
``Popen.returncode``: negative for a signal).

With ``"sandbox"`` (``{"mounts", "account"}``) the child first makes its job's sandbox
(`backend.namespaces`): the child the server reports is then the sandbox's keeper, and its exit
code is the worker's as bwrap reports it (``128 + N`` for a signal).

This module is the server and the client side of that format; it imports nothing of the
project but `backend.contract` and `backend.namespaces` (the targets are loaded by name, in
the server). The clients:
`ForkServer` here (synchronous; the launcher and the tests), and the agent's asyncio
`backend.agent.spawner.Spawner`.
"""
from __future__ import annotations

import array
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from backend import namespaces
from backend.contract import ENV_CONTROL_FD, ENV_HASH_SEED, ENV_SANDBOXED, with_hash_seed

ROOT = Path(__file__).resolve().parents[1]
CONTROL_FD = 3  # where a child finds its control pipe (SINGULARITY_CONTROL_FD)
MAX_FDS = 4  # stdin, stdout, stderr[, control]
SEND_BUFFER = 4 << 20  # one request (its environment) must fit in one packet


@dataclass(frozen=True)
class Target:
    #: ``sys.argv[0]`` of the child (``python -m`` would show the module)
    argv0: str
    #: what a child may need, imported once by the server (missing ones are skipped)
    preload: tuple[str, ...]
    #: ``module:function`` called once after the preload, to fill caches every child inherits
    warm: tuple[str, ...] = ()


#: imported first by every server: it registers the clearing of a script's globals at exit,
#: which must come after every other atexit handler, as in a plain interpreter (and atexit runs
#: last what it got first)
FIRST = "backend.proxy.engine.exit_handlers"

#: what a child may run: ``main(argv) -> int`` of these modules
TARGETS: dict[str, Target] = {
    # a rank of a job, for the agent (DDP's lazy imports included)
    "backend.worker.main": Target("backend.worker", (
        FIRST, "backend.worker.main", "backend.proxy", "backend.proxy.distributed.collectives",
        "backend.proxy.distributed.cut", "cloudpickle", "numpy", "torch", "torch.distributed",
        "torch.nn.parallel", "torch._dynamo"), warm=("backend.proxy.checkpoint.fingerprint:warm",)),
    # a rank of the local multi-rank launcher (tests, benchmarks)
    "backend.proxy.launch": Target("backend.proxy.launch", (
        FIRST, "torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
        "backend.proxy.distributed.collectives", "backend.proxy.launch")),
    # ``python -m backend.proxy`` (the proxy's CLI tests)
    "backend.proxy.__main__": Target("backend.proxy", (
        FIRST, "cloudpickle", "numpy", "torch", "torch.utils.data", "backend.proxy.__main__")),
}


def die_with_parent() -> None:
    """If the parent dies, this process must not run on unsupervised: a worker or the zygote
    whose agent died is killed (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1 and not os.environ.get(ENV_SANDBOXED):  # in a sandbox, pid 1 is its init
        os._exit(1)


# ---------------------------------------------------------------------------- the server side
def _recv(sock: socket.socket) -> tuple[Optional[dict[str, Any]], list[int]]:
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if not msg:
        return None, list(fds)
    return json.loads(msg), list(fds)


def _child(request: dict[str, Any], fds: list[int], sock_fd: int) -> None:
    """In the forked child: become the process a fresh ``python -m TARGET ARGV`` would be."""
    rc = 1
    try:
        if sock_fd not in fds:
            os.close(sock_fd)  # the user's code must not reach the server's socket
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2, CONTROL_FD), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > len(fds) - 1:
                os.close(fd)
        if request.get("sandbox") is not None:  # returns in the sandbox's worker only
            namespaces.enter(request["sandbox"]["mounts"], request["sandbox"].get("account"))
        os.chdir(request["cwd"])
        if request.get("umask") is not None:
            os.umask(request["umask"])  # the job's, not the service's 077
        salt = os.environ.get(ENV_HASH_SEED)
        os.environ.clear()
        os.environ.update(request["env"])
        if salt is not None:  # the child hashes strings with the server's salt, whatever it was asked
            os.environ[ENV_HASH_SEED] = salt
        if len(fds) > CONTROL_FD:
            os.environ[ENV_CONTROL_FD] = str(CONTROL_FD)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _like_a_fresh_interpreter(request["cwd"], request["env"])
        sys.argv = [TARGETS[request["target"]].argv0, *request["argv"]]
        main = importlib.import_module(request["target"]).main
        try:
            rc = main(request["argv"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # the child leaves with os._exit below, which would skip them
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0 if rc is None else rc if isinstance(rc, int) else 1)


def _exit_finalizers_stay_here() -> None:
    """Finalizers registered while preloading belong to this server, not to its children: a
    child leaves with ``os._exit`` after its own exit functions, and running these too only
    spent 60-70 ms of CPU per job (torch deregistering its operator libraries one by one,
    freeing memory the exit frees anyway), or worse, removed this server's temporary folders.
    The job's own finalizers, registered after the fork, still run at its exit."""
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        fin.atexit = False


def _like_a_fresh_interpreter(cwd: str, env: dict[str, str]) -> None:
    """What the server fixed at import time and a fresh interpreter would have chosen itself."""
    sys.path[0] = cwd  # ``python -m`` puts the working directory first
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if "numpy.random" in sys.modules:  # seeded from the OS at import: every child would agree
        sys.modules["numpy.random"].seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        # OpenMP read the server's environment when torch loaded; intra-op thread counts change
        # float results, so the child's own count must apply.
        threads = env.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)


def report_exits(running: dict[int, str], say: Callable[[dict], object]) -> None:
    """Reap the children that have exited: ``say({"id", "rc"})`` for each (``rc`` as
    ``Popen.returncode``: negative for a signal), without blocking."""
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        rid = running.pop(pid, None)
        if rid is not None:
            say({"id": rid, "rc": os.waitstatus_to_exitcode(status)})


def serve(fd: int, targets: Iterable[str], with_parent: bool = False) -> None:
    """The server's loop: fork a child per request, report pids and exit codes, until the
    client closes its end. ``with_parent``: die with the client (see `die_with_parent`)."""
    if with_parent:
        die_with_parent()  # the agent's death takes the zygote along, and its workers with it
    for target in targets:
        for name in TARGETS[target].preload:
            try:
                __import__(name)
            except ImportError:
                pass
        for hook in TARGETS[target].warm:
            module, _, function = hook.partition(":")
            getattr(importlib.import_module(module), function)()
    _exit_finalizers_stay_here()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A CUDA context does not survive fork(): children could not use their device.
        print("forkserver: CUDA was initialised while preloading; not forking", file=sys.stderr)
        return
    sock = socket.socket(fileno=fd)

    def say(msg: dict[str, Any]) -> None:
        sock.sendall(json.dumps(msg).encode())

    running: dict[int, str] = {}
    say({"ready": True})
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02 if running else 1.0)
        if ready:
            request, fds = _recv(sock)
            if request is None:
                return  # the client closed its end
            if request.get("target") not in TARGETS or not 3 <= len(fds) <= MAX_FDS:
                for f in fds:
                    os.close(f)
                say({"id": request.get("id"), "pid": -1, "error": "unknown target or wrong number of descriptors"})
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, fds, fd)
            for f in fds:
                os.close(f)
            running[pid] = request["id"]
            say({"id": request["id"], "pid": pid})
        report_exits(running, say)


# ---------------------------------------------------------------------------- the client side
def server_process(targets: Sequence[str], env: Optional[dict[str, str]] = None, with_parent: bool = False,
                   ) -> tuple[socket.socket, socket.socket, list[str], dict[str, str]]:
    """What a client needs to start a server for ``targets``: its own end of the socket pair, the
    server's end (to pass to the server as a descriptor, then close), the command line and the
    server's environment (``env``, os.environ by default, with its requirements). With
    ``with_parent`` the server dies with the thread that starts it (``PR_SET_PDEATHSIG``: only
    for a client whose starting thread lives as long as it does, as the agent's event loop)."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"not a fork server target: {unknown}")
    # Datagram-like packets: one request and its descriptors per packet, never merged or split.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    # The server computes nothing, and must not initialise CUDA (fork would break it in the
    # children): torch's availability checks then ask NVML instead of the CUDA runtime.
    # Forked children share the server's string-hash salt: a fixed one, the same on every node.
    server_env = {**with_hash_seed(dict(os.environ if env is None else env)), "OMP_NUM_THREADS": "1",
                  "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    command = [sys.executable, "-m", "backend.forkserver", str(theirs.fileno()),
               *(["--die-with-parent"] if with_parent else []), *targets]
    return mine, theirs, command, server_env


def send_request(sock: socket.socket, rid: str, target: str, argv: Sequence[str], env: dict[str, str],
                 cwd: str, fds: Sequence[int], umask: Optional[int] = None,
                 sandbox: Optional[dict[str, Any]] = None) -> None:
    """One request, with the child's descriptors (stdin, stdout, stderr[, control]) attached;
    the caller closes its copies afterwards. Raises OSError if the server is gone. ``sandbox``:
    ``{"mounts", "account"}`` for `backend.namespaces.enter`, made before anything else runs."""
    request: dict[str, Any] = {"id": rid, "target": target, "argv": list(argv), "env": env, "cwd": cwd}
    if umask is not None:
        request["umask"] = umask
    if sandbox is not None:
        request["sandbox"] = sandbox
    sock.sendmsg([json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


class ForkedProcess:
    """A child of a `ForkServer`, with the parts of ``subprocess.Popen`` its users need."""

    def __init__(self, server: "ForkServer", rid: str, pid: int) -> None:
        self._server, self._rid, self.pid = server, rid, pid

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def poll(self) -> Optional[int]:
        with self._server._cond:
            return self._server._rcs.get(self._rid)

    def wait(self, timeout: Optional[float] = None) -> int:
        with self._server._cond:
            if not self._server._cond.wait_for(lambda: self._rid in self._server._rcs, timeout):
                raise subprocess.TimeoutExpired(f"forked {self._rid}", timeout or 0)
            return self._server._rcs[self._rid]

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """A synchronous client: starts a server for ``targets`` and forks children from it."""

    def __init__(self, targets: Sequence[str], env: Optional[dict[str, str]] = None) -> None:
        if env is None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self._sock, theirs, command, server_env = server_process(targets, env)
        self._proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      env=server_env, cwd=str(ROOT))
        theirs.close()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pids: dict[str, int] = {}
        self._rcs: dict[str, int] = {}
        self._n = 0
        self._alive = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    packet = self._sock.recv(65536)
                except OSError:
                    break
                if not packet:
                    break
                msg = json.loads(packet)
                with self._cond:
                    if "pid" in msg:
                        self._pids[msg["id"]] = msg["pid"]
                    elif "rc" in msg:
                        self._rcs[msg["id"]] = msg["rc"]
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._alive = False
                for rid in self._pids:  # its children are presumed dead with it
                    self._rcs.setdefault(rid, -signal.SIGKILL)
                self._cond.notify_all()

    def start(self, target: str, argv: Sequence[str], env: dict[str, str], cwd: str, stdout: str,
              stderr: str, sandbox: Optional[dict[str, Any]] = None) -> ForkedProcess:
        """Fork ``target``'s main(argv) with the whole environment ``env``, stdin from
        /dev/null and stdout/stderr written to the files ``stdout`` and ``stderr`` (in
        ``sandbox``, as `send_request` says)."""
        with self._cond:
            self._n += 1
            rid = str(self._n)
        fds = [os.open(os.devnull, os.O_RDONLY)]
        try:
            for path in (stdout, stderr):
                fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            with self._send_lock:
                send_request(self._sock, rid, target, argv, env, cwd, fds, sandbox=sandbox)
        finally:
            for fd in fds:  # the child has its copies
                os.close(fd)
        with self._cond:
            self._cond.wait_for(lambda: rid in self._pids or not self._alive)
            pid = self._pids.get(rid, -1)
        if pid < 0:
            raise RuntimeError(f"the fork server could not start {target} (see its stderr)")
        return ForkedProcess(self, rid, pid)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the server sees the end (and so does our reader)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    _args = sys.argv[2:]
    serve(int(sys.argv[1]), [a for a in _args if a != "--die-with-parent"], "--die-with-parent" in _args)
