"""Worker processes of one job attempt on one node: start, stream output, stop, report exit.

Each rank is a ``python -m backend.worker`` (forked from the node's warm spawner when it is
ready, else a fresh interpreter) in its own session (so DataLoader workers and other children
die with it), with the devices and thread count it was given.
Output is read line by line and handed to ``emit`` as it appears. A second pipe carries the
worker's structured messages (progress, checkpoint results) without mixing them into the
user's output; the worker's stdin carries the agent's requests (checkpoint now).
"""
from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import signal
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from backend import contract
from backend.contract import EXIT_PREEMPTED
from backend.proxy.checkpoint.store import CheckpointStore
from backend.worker import output_marks
from singularity_sdk.protocol import DeviceInfo, EventType, StartJob

from . import accounts, sandbox
from .accounts import Account
from .devices import gpu_minor_numbers, slot_cores
from .outbox import LOG_EVENT_CHARS
from .spawner import Spawner, WarmProcess

Emit = Callable[[EventType, dict[str, Any]], None]
#: Runs on each committed checkpoint before it is reported (uploads it where nodes share no disk);
#: returns extra event data, or raises to turn the report into checkpoint_failed.
OnCheckpoint = Callable[["JobRun", dict[str, Any]], Awaitable[dict[str, Any]]]
LINE_LIMIT = 1 << 20
#: how long a marked message and the lines after its mark wait for each other
MARK_WAIT_S = 5.0
#: "0" lets workers on CPU slots run on every core (by default a slot's ranks get its cores)
PIN_ENV = "SINGULARITY_PIN_CPU_SLOTS"


@dataclass
class RankProcess:
    rank: int
    proc: Any  # asyncio.subprocess.Process, or a spawner.WarmProcess with the same face
    control_reader: asyncio.StreamReader
    readers: list[asyncio.Task] = field(default_factory=list)
    #: the process group to signal (a sandbox's own, not bwrap's); None: the process's pid
    pgid: Optional[int] = None
    #: bytes of output passed on so far, per stream (what `_drain_output` waits for)
    passed: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    #: output marks (backend/worker/output_marks.py): the newest each stream's pump has reached,
    #: and the newest whose control message has been passed on
    reached: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    released: int = 0
    control_closed: bool = False


class JobRun:
    """The ranks of one (job, attempt) placed on this node."""

    def __init__(self, spec: StartJob, run_dir: Path, devices: list[DeviceInfo], threads_per_slot: int,
                 checkpoint_root: Path, emit: Emit, on_checkpoint: Optional[OnCheckpoint] = None,
                 spawner: Optional[Spawner] = None, bwrap: Optional[str] = None,
                 hidden: tuple[Path, ...] = (), account: Optional[Account] = None,
                 agent_lease_s: Optional[float] = None):
        self.spec = spec
        self.run_dir = run_dir
        self.devices = {d.index: d for d in devices}
        self.threads_per_slot = threads_per_slot
        self.checkpoint_root = checkpoint_root
        self.emit = emit
        #: through a store: how long fetching the checkpoint took before the start, and how many of
        #: its bytes were copied while the source still wrote it (agent.py sets it)
        self.fetched: dict[str, Any] = {}
        self.on_checkpoint = on_checkpoint
        self.spawner = spawner
        #: sandbox workers with this bwrap, covering ``hidden`` (the service's folders)
        self.bwrap = bwrap
        self.hidden = hidden
        #: the OS account the workers run as (serve --run-as; accounts.py), inside the sandbox
        self.account = account
        #: a worker that has not heard from the agent this long ends itself (agent.py)
        self.agent_lease_s = agent_lease_s
        self.ranks: dict[int, RankProcess] = {}
        self.exit_codes: dict[int, int] = {}
        self.stopping: Optional[str] = None
        #: why the ranks were asked to checkpoint and stop (a planned stop of this node)
        self.planned_stop: Optional[str] = None
        self.done = asyncio.Event()
        self._waiters: list[asyncio.Task] = []

    @property
    def key(self) -> tuple[str, int]:
        return (self.spec.job_id, self.spec.attempt)

    def _env(self, rank_spec) -> dict[str, str]:
        spec = self.spec
        devs = [self.devices[i] for i in rank_spec.devices]
        gpus = [d for d in devs if d.kind == "cuda"]
        env = {k: v for k, v in os.environ.items() if k not in sandbox.SECRET_ENV}
        env.update(spec.env)
        env = contract.with_hash_seed(env)  # a fresh interpreter salts its string hashes as a fork would
        # A fixed thread count per slot: float results must not depend on the node's core count.
        threads = str(self.threads_per_slot * max(1, len(devs)))
        env.update({
            "RANK": str(rank_spec.rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_RANK": str(rank_spec.local_rank),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(spec.master_port),
            contract.ENV_RENDEZVOUS: f"{spec.master_addr}:{spec.master_port}",
            "CUDA_VISIBLE_DEVICES": ",".join(d.uuid or str(d.index) for d in gpus),
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            contract.ENV_THREADS: threads,
            contract.ENV_JOB_ID: spec.job_id,
            contract.ENV_ATTEMPT: str(spec.attempt),
            contract.ENV_DEVICES: json.dumps([d.model_dump() for d in devs]),
            contract.ENV_CHECKPOINT_DIR: str(self.checkpoint_root / spec.job_id),
            # synced copies of jobs' folders (backend/worker/workdir.py), under the agent's home
            contract.ENV_WORKDIR_ROOT: str((self.run_dir.parent.parent / "workdirs").resolve()),
            "PYTHONUNBUFFERED": "1",
        })
        if self.account is not None:
            env.update(self.account.env())
        if self.agent_lease_s is not None:
            env[contract.ENV_AGENT_LEASE] = f"{self.agent_lease_s:g}"
        cpu_slots = [d for d in devs if d.kind == "cpu"]
        if cpu_slots and os.environ.get(PIN_ENV, "1") != "0":
            slots = sum(1 for d in self.devices.values() if d.kind == "cpu")
            cores = sorted({c for d in cpu_slots for c in slot_cores(d.index, slots)})
            env[contract.ENV_CPUS] = ",".join(map(str, cores))
        if spec.layout:
            # Ranks that share a slot take turns on it. LOCAL_RANK / LOCAL_WORLD_SIZE stay
            # torchrun's (this job's ranks on this node: "local rank 0 downloads the data" must
            # hold once per node), except on GPUs: a rank sees only its own device, as cuda:0,
            # so code that indexes devices by LOCAL_RANK needs 0 there.
            env[contract.ENV_PLACEMENT] = spec.layout
            if gpus:
                env.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        return env

    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.run_dir / contract.SPEC_FILE
        spec_path.write_text(self.spec.model_dump_json())
        for rs in self.spec.ranks:
            contract.rank_dir(self.run_dir, rs.rank).mkdir(exist_ok=True)
        if self.account is not None:
            accounts.give(self.account, [self.run_dir])
        for rs in self.spec.ranks:
            rank_dir = contract.rank_dir(self.run_dir, rs.rank)
            r_fd, w_fd = os.pipe()
            env = self._env(rs)
            env[contract.ENV_CONTROL_FD] = str(w_fd)
            argv = [str(spec_path), str(rank_dir)]
            proc: Any = None
            pgid: Optional[int] = None
            # a fork hashes strings with the spawner's salt: a job that asks for another gets a fresh interpreter
            forkable = env.get(contract.ENV_HASH_SEED) == contract.HASH_SEED
            if self.bwrap is not None:
                proc, pgid = await self._spawn_sandboxed(argv, env, rank_dir, w_fd, forkable)
            elif self.spawner is not None and forkable:
                proc = await self.spawner.spawn(argv, env, str(rank_dir), w_fd, LINE_LIMIT)
            if proc is None:  # no warm spawner (yet): a fresh interpreter
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "backend.worker", *argv,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    env=env, cwd=str(rank_dir), pass_fds=(w_fd,), start_new_session=True, limit=LINE_LIMIT,
                    umask=sandbox.job_umask(),
                )
            os.close(w_fd)
            self.ranks[rs.rank] = await self.follow(rs.rank, proc, r_fd, pgid)
        self.emit(EventType.STARTED, {
            "ranks": sorted(self.ranks), "pids": {r: p.proc.pid for r, p in self.ranks.items()},
            # how each rank began: "fork" of the warm spawner or "fresh" interpreter, "+sandbox"
            "spawn": {r: ("fork" if isinstance(p.proc, WarmProcess) else "fresh") + ("+sandbox" if p.pgid else "")
                      for r, p in self.ranks.items()},
            "devices": sorted({d for rs in self.spec.ranks for d in rs.devices}), "attempt": self.spec.attempt,
            **self.fetched,
        })
        self._waiters = [asyncio.create_task(self._wait(rp)) for rp in self.ranks.values()]
        asyncio.create_task(self._all_done())

    async def follow(self, rank: int, proc: Any, control_fd: int, pgid: Optional[int] = None) -> RankProcess:
        """Pass on a started rank's output and its control messages (read from ``control_fd``)."""
        control = asyncio.StreamReader(limit=LINE_LIMIT)
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), os.fdopen(control_fd, "rb"))
        rp = RankProcess(rank, proc, control, pgid=pgid)
        rp.readers = [
            asyncio.create_task(self._pump(rp, proc.stdout, "stdout")),
            asyncio.create_task(self._pump(rp, proc.stderr, "stderr")),
            asyncio.create_task(self._control(rp)),
        ]
        return rp

    def _own_gpu_minors(self) -> Optional[set[int]]:
        """The minor numbers of this job's GPUs on this node (None: NVML cannot say)."""
        minors = gpu_minor_numbers()
        if minors is None:
            return None
        gpus = [self.devices[i] for rs in self.spec.ranks for i in rs.devices if self.devices[i].kind == "cuda"]
        return {minors[d.uuid] for d in gpus if d.uuid in minors}

    async def _spawn_sandboxed(self, argv: list[str], env: dict[str, str], rank_dir: Path,
                               w_fd: int, forkable: bool = True) -> tuple[Any, int]:
        """A worker inside its sandbox (backend/agent/sandbox.py); returns the process and the
        sandbox's process group, which is what stop signals. A fork of the warm spawner makes
        the sandbox itself (backend/namespaces.py) once the spawner is ready; until then a
        fresh interpreter starts under bwrap."""
        assert self.bwrap is not None
        ckpt = self.checkpoint_root / self.spec.job_id
        ckpt.mkdir(parents=True, exist_ok=True)
        visible = [self.run_dir, ckpt]
        if self.spec.workdir_b64:
            copy = Path(env[contract.ENV_WORKDIR_ROOT], self.spec.job_id)
            copy.mkdir(parents=True, exist_ok=True)
            visible.append(copy)
        if self.account is not None:  # the job's own folders become its account's
            accounts.give(self.account, list(visible))
        if self.spec.workdir:
            visible.append(Path(self.spec.workdir))
        env = {**env, contract.ENV_SANDBOXED: "1"}
        mounts = sandbox.plan(self.hidden, visible, sandbox.gpu_files_to_mask(self._own_gpu_minors()), self.account)
        if self.spawner is not None and forkable:
            proc = await self.spawner.spawn(argv, env, str(rank_dir), w_fd, LINE_LIMIT, sandbox={
                "mounts": [m.as_dict() for m in mounts], "account": self.account and self.account.ids()})
            if proc is not None:
                return proc, proc.pid  # the keeper leads the sandbox's session
        info_r, info_w = os.pipe()
        try:
            cmd = sandbox.command(self.bwrap, [sys.executable, "-m", "backend.worker", *argv], mounts, info_w,
                                  self.account)
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=env, cwd=str(rank_dir), pass_fds=(w_fd, info_w), start_new_session=True, limit=LINE_LIMIT,
                umask=sandbox.job_umask(),
            )
        finally:
            os.close(info_w)
        try:
            raw = await asyncio.to_thread(_read_all, info_r)
        finally:
            os.close(info_r)
        try:
            return proc, int(json.loads(raw)["child-pid"])
        except (ValueError, KeyError, TypeError):  # bwrap failed before it cloned: its exit says why
            return proc, proc.pid

    async def _pump(self, rp: RankProcess, stream: asyncio.StreamReader, name: str) -> None:
        carry = b""  # a partial line printed just before a mark
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than LINE_LIMIT: pass it on in pieces
                line = await stream.read(LINE_LIMIT)
            if not line:
                if carry:
                    self.emit(EventType.LOG, {"rank": rp.rank, "stream": name, "line": carry.decode("utf-8", "replace")})
                return
            rp.passed[name] += len(line)
            text, mark = output_marks.split(line)
            if mark is not None:
                carry += text
                rp.reached[name] = mark
                # the lines after the mark wait for the control message it stands for
                await _until(lambda: rp.released >= mark or rp.control_closed, MARK_WAIT_S)
                continue
            line, carry = carry + text, b""
            if line.endswith(b"\n"):
                more = _whole_lines_buffered(stream)
                if more:
                    line += await stream.readexactly(more)  # buffered: returns at once
                    rp.passed[name] += more
            self.emit(EventType.LOG, {"rank": rp.rank, "stream": name, "line": line.decode("utf-8", "replace")})

    async def _control(self, rp: RankProcess) -> None:
        """Structured messages from the worker: ``{"type": <event type>, "data": {...}}`` per line."""
        while True:
            line = await rp.control_reader.readline()
            if not line:
                rp.control_closed = True
                return
            try:
                msg = json.loads(line)
                etype = EventType(msg["type"])
            except (ValueError, KeyError, TypeError):
                continue
            data = {"rank": rp.rank, **msg.get("data", {})}
            mark, number = data.pop("output_mark", None), None
            if isinstance(mark, dict) and isinstance(mark.get("number"), int):
                # every line printed before it is passed on first, none printed after it
                number, streams = mark["number"], [n for n in mark.get("streams", []) if n in rp.reached]
                await _until(lambda: all(rp.reached[n] >= number for n in streams), MARK_WAIT_S)
            elif etype in (EventType.CHECKPOINT_STARTED, EventType.CHECKPOINTED):
                await _drain_output(rp)
            if etype == EventType.CHECKPOINTED and self.on_checkpoint is not None:
                try:
                    data.update(await self.on_checkpoint(self, data))
                except Exception as exc:
                    etype, data = EventType.CHECKPOINT_FAILED, {
                        "rank": rp.rank, "error": f"the checkpoint was written but could not be stored: {exc}"}
            self.emit(etype, data)
            if number is not None:
                rp.released = max(rp.released, number)

    async def _wait(self, rp: RankProcess) -> None:
        code = await rp.proc.wait()
        if rp.pgid is not None:
            code = sandbox.exit_code(code)
        self.exit_codes[rp.rank] = code
        await asyncio.gather(*rp.readers, return_exceptions=True)
        rank_dir = contract.rank_dir(self.run_dir, rp.rank)
        if rp.rank == 0 and code == 0:
            self._emit_result(rank_dir)
        error = None
        err_file = rank_dir / contract.ERROR_FILE
        if err_file.exists():
            error = err_file.read_text(errors="replace")
        data: dict[str, Any] = {"rank": rp.rank, "code": code}
        if code < 0:
            data["signal"] = signal.Signals(-code).name if -code in signal.valid_signals() else -code
        if self.stopping:
            data["stopped"] = self.stopping
        elif self.planned_stop and code == EXIT_PREEMPTED:
            data["planned_stop"] = self.planned_stop
        if error:
            data["error"] = error
            data["user_error"] = True  # the code raised: retrying would raise again
        elif code not in (0, EXIT_PREEMPTED) and not self.stopping:
            data["error"] = _exit_description(code)
        self.emit(EventType.WORKER_EXITED, data)

    def _emit_result(self, rank_dir: Path) -> None:
        res = rank_dir / contract.RESULT_PICKLE
        rep = rank_dir / contract.RESULT_REPR
        err = rank_dir / contract.RESULT_ERROR
        if not (res.exists() or err.exists()):
            return
        outs = rank_dir / contract.OUTPUTS_PICKLE
        skipped = rank_dir / contract.OUTPUTS_SKIPPED
        self.emit(EventType.RESULT, {
            "outputs_b64": base64.b64encode(outs.read_bytes()).decode() if outs.exists() else None,
            "outputs_skipped": json.loads(skipped.read_text()) if skipped.exists() else {},
            "pickle_b64": base64.b64encode(res.read_bytes()).decode() if res.exists() else None,
            "repr": rep.read_text(errors="replace") if rep.exists() else "",
            "error": err.read_text(errors="replace") if err.exists() else None,
        })

    async def _all_done(self) -> None:
        await asyncio.gather(*self._waiters, return_exceptions=True)
        if self.spec.world_size > 1 and len(self.exit_codes) == self.spec.world_size \
                and set(self.exit_codes.values()) == {0}:
            # Every rank of the job ran here and finished: its checkpoints have served their
            # purpose (a one-rank job's worker clears its own; ranks on several nodes leave them).
            CheckpointStore(self.checkpoint_root / self.spec.job_id).clear()
        self.done.set()

    def send_control(self, message: dict[str, Any]) -> None:
        """Write one request line to every rank's stdin (e.g. ``{"op": "checkpoint"}``)."""
        payload = (json.dumps(message) + "\n").encode()
        for rp in self.ranks.values():
            if rp.proc.stdin is not None and rp.proc.returncode is None:
                try:
                    rp.proc.stdin.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

    async def stop(self, reason: str, grace_s: float) -> None:
        """End every rank now, without a checkpoint: the ``exit`` request, then SIGKILL for what is
        left after ``grace_s`` (a rank that is not reading its requests yet, its children).
        SIGTERM is not used: to a worker it means "checkpoint and stop" (a preemption notice)."""
        self.stopping = self.stopping or reason
        self.send_control({"op": "exit"})
        try:
            await asyncio.wait_for(self.done.wait(), grace_s)
        except asyncio.TimeoutError:
            self._signal_all(signal.SIGKILL)
            await self.done.wait()
        self._signal_all(signal.SIGKILL, exited_too=True)  # DataLoader workers and other children

    async def stop_at_checkpoint(self, reason: str, timeout_s: float) -> None:
        """A planned stop: every rank checkpoints at its next safe point and exits, so the job
        resumes where it stopped; what has not within ``timeout_s`` is ended by `stop`."""
        self.planned_stop = reason
        self.send_control({"op": "checkpoint", "then": "stop", "reason": reason, "timeout_s": timeout_s})
        try:
            await asyncio.wait_for(self.done.wait(), timeout_s + 2.0)
        except asyncio.TimeoutError:
            await self.stop(f"{reason} (no checkpoint within {timeout_s:g} s)", 1.0)

    def _signal_all(self, sig: signal.Signals, exited_too: bool = False) -> None:
        for rp in self.ranks.values():
            if rp.proc.returncode is None or exited_too:
                try:
                    os.killpg(rp.pgid or rp.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    """Yield to the other readers until ``condition`` holds (at most ``timeout`` seconds: a rank
    killed between its mark and its message must not hold its output back for good)."""
    deadline = time.monotonic() + timeout
    spins = 0
    while not condition() and time.monotonic() < deadline:
        spins += 1
        await asyncio.sleep(0 if spins < 100 else 0.002)


async def _drain_output(rp: RankProcess, timeout: float = 2.0) -> None:
    """Let the output pumps pass on every whole line the rank wrote before its last control
    message, for messages without an output mark. Its output is unbuffered and was written first,
    so those bytes are, when the message is handled, either still in the kernel's pipe or in the
    reader's buffer: wait until the pumps have passed on all of them but a partial last line.
    Lines printed after the message may still come before it (a marked message is exact both
    ways). A rank that prints without pause holds the event back for at most ``timeout``."""
    targets = {}
    for name in ("stdout", "stderr"):
        stream = getattr(rp.proc, name, None)
        if stream is not None:
            targets[name] = (stream, rp.passed[name] + len(_buffered(stream)) + _in_pipe(stream))

    def passed_on() -> bool:
        for name, (stream, target) in targets.items():
            if rp.reached[name] > rp.released:
                continue  # its pump waits at a later mark, for a message behind this one
            buffered = _buffered(stream)
            if rp.passed[name] + len(buffered) < target and not stream.at_eof():
                return False  # bytes from before the message not read from the pipe yet
            if b"\n" in buffered[:max(0, target - rp.passed[name])]:
                return False  # a whole line from before the message not passed on yet
        return True

    await _until(passed_on, timeout)


def _buffered(stream: asyncio.StreamReader) -> bytes:
    # StreamReader has no public peek; its buffer holds what was read from the pipe, not yet passed on
    return bytes(getattr(stream, "_buffer", b""))


def _whole_lines_buffered(stream: asyncio.StreamReader) -> int:
    """How many bytes of whole lines, none of them a mark, the reader holds already (at most
    one log event's worth, ``LOG_EVENT_CHARS``): they go out with the line just read, in one
    event, without waiting, so a rank's lines cost an event each only when it prints slowly."""
    buffered = getattr(stream, "_buffer", b"")[:LOG_EVENT_CHARS]
    end = buffered.rfind(b"\n") + 1
    mark = buffered.find(output_marks.PREFIX, 0, end)
    if mark >= 0:  # stop before the line that holds the mark: its pump loop handles it
        end = buffered.rfind(b"\n", 0, mark) + 1
    return end


def _in_pipe(stream: asyncio.StreamReader) -> int:
    """Bytes written to the stream's pipe that its transport has not read yet (0 if unknown)."""
    transport = getattr(stream, "_transport", None)
    pipe = transport.get_extra_info("pipe") if transport is not None else None
    try:
        fd = pipe.fileno() if pipe is not None else -1
        if fd < 0:
            return 0
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except (OSError, ValueError, AttributeError):
        return 0


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f"the worker was killed by {name}{hint}"
    return f"the worker exited with code {code}"
