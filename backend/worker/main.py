"""One rank of a job: run the submitted code as ``__main__`` and leave its outcome in files.

The agent reads what this process leaves behind (``result.pkl``/``result.repr`` or
``error.txt``) after it exits, so the result survives even if the agent's connection to the
server does not. User output goes to stdout/stderr untouched; structured messages for the
agent go to the control pipe.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from backend import contract
from backend.contract import EXIT_PREEMPTED, WorkerSpec
from backend.forkserver import die_with_parent

from . import output_marks
from .workdir import enter as enter_workdir


class ControlChannel:
    """Worker -> agent messages on the pipe the agent passed in ``SINGULARITY_CONTROL_FD``."""

    def __init__(self) -> None:
        fd = os.environ.get(contract.ENV_CONTROL_FD)
        self._out = os.fdopen(int(fd), "w", buffering=1) if fd else None
        self._lock = threading.Lock()
        self._marks = 0

    def send(self, type: str, data: dict[str, Any]) -> None:
        if self._out is None:
            return
        with self._lock:
            if type in output_marks.MARKED:
                self._marks += 1
                data = {**data, "output_mark": {"number": self._marks, "streams": output_marks.write(self._marks)}}
            line = json.dumps({"type": type, "data": data}, default=str)
            try:
                self._out.write(line + "\n")
            except (BrokenPipeError, OSError):
                pass


def format_user_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the user's code on: the worker's frames are noise."""
    tbe = traceback.TracebackException.from_exception(exc)
    frames = tbe.stack
    start = next((i for i, f in enumerate(frames) if f.filename == filename), None)
    if start is None:
        start = next((i for i, f in enumerate(frames) if not _is_ours(f.filename)), 0)
    tbe.stack = traceback.StackSummary.from_list(frames[start:])
    return "".join(tbe.format())


def _is_ours(path: str) -> bool:
    here = str(Path(__file__).resolve().parent.parent)
    return path.startswith(here)


def load_program(spec: WorkerSpec, filename: str = ""):
    """The submitted code as a ResumableProgram: a cell/script, or a callable and its arguments."""
    from backend.proxy import ResumableProgram

    if spec.source is not None:
        return ResumableProgram.from_source(spec.source, filename or spec.filename)
    import base64

    import cloudpickle

    payload = cloudpickle.loads(base64.b64decode(spec.callable_b64 or ""))
    fn, args, kwargs = payload[:3]
    source = payload[3] if len(payload) > 3 else None  # captured by the SDK: the worker has no file
    return ResumableProgram.from_callable(fn, args, kwargs, source=source)


def listen_for_requests(controller) -> None:
    """The agent's requests arrive as JSON lines on stdin: ``{"op": "checkpoint", "then": ...}``,
    ``{"op": "exit"}`` (cancel, or the job failed elsewhere: end now, no checkpoint), and every
    second ``{"op": "alive"}``: with ``SINGULARITY_AGENT_LEASE`` set, a worker that has heard
    nothing for that long ends itself (`watch_agent`).

    They are read from a private duplicate of the descriptor with ``os.read``, and the job's own
    stdin becomes /dev/null: a thread blocked inside ``sys.stdin`` holds its lock, and a process
    forked meanwhile (a DataLoader worker closes ``sys.stdin`` on start) would hang on it."""
    fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, "r", closefd=False)

    heard = [time.monotonic()]

    def loop() -> None:
        buffer = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            heard[0] = time.monotonic()
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("op") == "checkpoint":
                    timeout = msg.get("timeout_s")
                    controller.request_checkpoint(msg.get("then", "continue"), msg.get("reason", ""),
                                                  float(timeout) if timeout else None)
                elif msg.get("op") == "exit":
                    _flush_and_exit(contract.EXIT_STOPPED)

    threading.Thread(target=loop, name="singularity-control", daemon=True).start()
    lease = os.environ.get(contract.ENV_AGENT_LEASE)
    if lease:
        threading.Thread(target=watch_agent, args=(heard, float(lease)), name="singularity-lease",
                         daemon=True).start()


def watch_agent(heard: list[float], lease: float) -> None:
    """End this worker once the agent has said nothing for ``lease`` seconds. A frozen or cut-off
    agent can neither stop it nor pass on its output, and by then the server has lost the node
    and placed the job elsewhere, from its newest checkpoint; running on would only hold the
    device. Nothing is flushed: a full output pipe nobody reads would block the exit."""
    while True:
        time.sleep(min(1.0, lease / 4))
        silent = time.monotonic() - heard[0]
        if silent > lease:
            try:
                os.set_blocking(2, False)
                os.write(2, f"singularity: no word from the node agent for {silent:.0f} s (lease {lease:g} s): "
                            f"this worker stops; the job runs on elsewhere\n".encode())
            except OSError:
                pass
            os._exit(contract.EXIT_STOPPED)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def stop_on_sigterm(controller) -> None:
    """SIGTERM (a preemption notice from Slurm or Kubernetes, or a person's ``kill``) takes a
    checkpoint at the next safe point and exits EXIT_PREEMPTED, so the job resumes where it
    stopped; a second SIGTERM ends the process at once. The agent's own stops use the ``exit``
    request instead. A program that installs its own SIGTERM handler replaces this one (a
    checkpoint saves the program's handler, not this one, nor the default action it puts back).

    A process the job forks (a ``multiprocessing.Pool``'s worker) must not inherit this handler:
    there SIGTERM does what it does without the service, end the process (``with Pool(2) as
    pool:`` terminates its workers with SIGTERM on exit and waited for them forever). So the
    forking thread holds SIGTERM back across ``fork()`` and the child puts the default action
    back before it lets it through (`_reset_in_forked_children`): one sent to the child as it was
    being made ends it too (with a Python handler in place, CPython drops a signal that arrives
    before its after-fork setup), and the child ends even while its Python code cannot run."""
    from backend.proxy.engine import process_settings

    owner = os.getpid()

    def on_term(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a child made without Python's fork hooks
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        process_settings.host_sets_signal(signal.SIGTERM, signal.SIG_DFL)
        controller.request_checkpoint("stop", "SIGTERM: the job was asked to stop (a preemption notice)")

    signal.signal(signal.SIGTERM, on_term)
    _reset_in_forked_children(on_term)


def _reset_in_forked_children(handler: Any) -> None:
    """While ``handler`` is this process's SIGTERM handler, a child forked from it starts with the
    default action, and a SIGTERM sent to it meanwhile is held until then (not dropped)."""
    forking = threading.local()  # the forking thread's signal mask before `before` blocked SIGTERM

    def before() -> None:
        forking.mask = None
        if signal.getsignal(signal.SIGTERM) is handler:
            forking.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def after_in_parent() -> None:
        if getattr(forking, "mask", None) is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, forking.mask)

    def after_in_child() -> None:
        if getattr(forking, "mask", None) is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, forking.mask)  # a SIGTERM held meanwhile ends it now

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)


def load_inputs(inputs_b64: Optional[str], namespace: dict[str, Any]) -> None:
    """Variables sent with the job (a notebook's names the cell reads) start in its namespace;
    the notebook's own functions among them read and write that namespace, as in the notebook."""
    if inputs_b64:
        import base64

        from singularity_sdk import unpickle

        namespace.update(unpickle.loads(base64.b64decode(inputs_b64), main_globals=namespace))


def save_outputs(names: list[str], namespace: dict[str, Any], out_dir: Path) -> None:
    """Pickle the requested names that exist and can be pickled; say why for the others."""
    import cloudpickle

    values, skipped = {}, {}
    for name in names:
        if name not in namespace:
            continue  # not assigned on this run (e.g. a branch not taken)
        try:
            cloudpickle.dumps(namespace[name])
        except Exception as exc:
            skipped[name] = f"{type(namespace[name]).__name__} cannot be pickled: {exc}"
            continue
        values[name] = namespace[name]
    (out_dir / contract.OUTPUTS_PICKLE).write_bytes(cloudpickle.dumps(values))
    (out_dir / contract.OUTPUTS_SKIPPED).write_text(json.dumps(skipped))


def save_result(value: Any, out_dir: Path) -> None:
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<unrepresentable {type(value).__name__}: {exc}>"
    (out_dir / contract.RESULT_REPR).write_text(text[:contract.RESULT_REPR_LIMIT])
    try:
        import cloudpickle

        blob = cloudpickle.dumps(value)
    except Exception as exc:
        (out_dir / contract.RESULT_ERROR).write_text(
            f"the result ({type(value).__name__}) cannot be pickled: {exc}; return plain data instead")
        return
    tmp = out_dir / f"{contract.RESULT_PICKLE}.tmp"
    tmp.write_bytes(blob)
    os.replace(tmp, out_dir / contract.RESULT_PICKLE)


#: how far a job stands behind its node's agent and server for the CPU: felt only while they
#: compete, and then log lines, checkpoints, preemptions and heartbeats go first
JOB_NICE = 10


def yield_to_the_control_plane(nice: int = JOB_NICE) -> None:
    """Lower this job's CPU priority below the control plane's. Under autogroup scheduling (the
    Linux default on many distributions) a process's nice ranks it only within its session, and
    each session's group gets an equal share: a job runs in a session of its own, so twenty busy
    jobs took twenty shares against the agents' and server's one, and their log lines waited
    ~150 ms for the server (bench/load.py). So both are set: the session group's nice where the
    kernel groups by session, the process's where it does not."""
    try:
        os.nice(nice)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup in this kernel, or /proc not ours to write
        pass


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.read(Path(argv[0]))
    out_dir = Path(argv[1]).resolve()  # the job may chdir: every path of ours is absolute
    die_with_parent()
    yield_to_the_control_plane()
    from backend.proxy import CheckpointStore, Preempted
    from backend.proxy.launch import pin_to_slot
    from backend.proxy.rank import RankCountMismatch, RankRun, main_namespace, run_rank

    pin_to_slot()  # a CPU slot's cores, as the agent chose them

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    filename = spec.filename
    channel = ControlChannel()
    store = CheckpointStore(Path(os.environ.get(contract.ENV_CHECKPOINT_DIR, out_dir / "checkpoints")).resolve())
    try:
        filename = enter_workdir(spec)  # argv, cwd, sys.path[0]: as `python script.py ARGS`
    except FileNotFoundError as exc:
        sys.stderr.write(f"singularity: {exc}\n")
        (out_dir / contract.ERROR_FILE).write_text(str(exc))
        return 1
    restored: list[Any] = []  # the CheckpointRef this run resumes, once known

    def on_event(type: str, data: dict[str, Any]) -> None:
        if type == "resumed":
            ref = restored[0] if restored else None
            data = {**data, "checkpoint": str(ref.path) if ref else None, "checkpoint_step": ref.step if ref else None}
        channel.send(type, data)

    events, reporter = distributed_events(rank, on_event) if world > 1 else (on_event, None)
    run = RankRun(store, rank, world, restore=spec.restore, checkpoint_every=spec.checkpoint_every, on_event=events)
    # a real `__main__` module (sys.modules): pickle finds the job's classes there by name, as it
    # does for `python train.py` (pickle.dump of a dataclass the job defines, torch.save(model))
    namespace = main_namespace(filename)

    def before(run: RankRun) -> None:
        if run.restored is None:
            if spec.restore:
                sys.stderr.write(f"singularity: no usable checkpoint under {store.root}; starting from the beginning\n")
            if world > 1 and rank == 0:
                store.discard_staging(-1)  # a crashed attempt's parts must not join a new checkpoint
            load_inputs(spec.inputs_b64, namespace)
            if rank == 0:  # before the first preemption, say whether one can succeed
                from backend.proxy.engine.interruptible import report

                on_event("interruptible", report(program))
        else:
            restored.append(run.restored)  # "resumed" is reported once it is in place
        listen_for_requests(run.controller)
        stop_on_sigterm(run.controller)

    try:
        program = load_program(spec, filename)
        value = run_rank(program, namespace, run, before)
    except RankCountMismatch as exc:
        sys.stderr.write(f"singularity: {exc}\n")
        return 2
    except Preempted:
        # The checkpoint is committed and fsynced; tearing down the interpreter (torch's
        # finalizers) would only delay freeing the device.
        if world > 1:
            # Neighbours on this device still need their turn to reach the same checkpoint;
            # rank 0 (whose process holds the job's rendezvous store) waits until all wrote it.
            from backend.proxy.distributed.collectives import shutdown_all

            shutdown_all()
        if reporter is not None:
            reporter.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
        if code:
            reserved = f" ({EXIT_PREEMPTED} means a stop at a checkpoint here: exited 1)" if code == EXIT_PREEMPTED else ""
            (out_dir / contract.ERROR_FILE).write_text(f"the job called sys.exit({exc.code!r}){reserved}")
        return contract.program_exit_code(code)
    except BaseException as exc:
        text = format_user_traceback(exc, filename)
        sys.stderr.write(text)
        (out_dir / contract.ERROR_FILE).write_text(text)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if reporter is not None:
        reporter.flush()
    if rank == 0:
        save_result(value, out_dir)
        if spec.outputs:
            save_outputs(spec.outputs, namespace, out_dir)
        if world == 1:
            store.clear()  # the job is done: its checkpoints have served their purpose
    return 0


def distributed_events(rank: int, on_event: Callable[[str, dict[str, Any]], None]):
    """One rank of W: the proxy's collective backend in place, and where this rank's events go.

    Every rank writes its part of each checkpoint, but the job has one event stream: rank 0
    speaks for the job, and reports a checkpoint only once the last rank has committed it. The
    other ranks report only what concerns them alone: a checkpoint they could not take, and
    where their output stands (``checkpoint_started``, with its output mark, and ``resumed``),
    so that after a crash each rank's re-executed lines supersede its own earlier ones."""
    from backend.proxy.launch import prepare_rank

    prepare_rank()
    reporter = CommitReporter(on_event) if rank == 0 else None

    def forward(type: str, data: dict[str, Any]) -> None:
        if type == "checkpoint_failed":
            on_event(type, {**data, "rank": rank})
        elif reporter is not None:
            reporter(type, data)
        elif type in ("checkpoint_started", "resumed"):
            on_event(type, data)

    return forward, reporter


class CommitReporter:
    """Rank 0's events; ``checkpointed`` waits (off the training thread) for the manifest."""

    def __init__(self, send: Callable[[str, dict[str, Any]], None], timeout_s: float = 600.0) -> None:
        self.send = send
        self.timeout_s = timeout_s
        self._threads: list[threading.Thread] = []

    def __call__(self, type: str, data: dict[str, Any]) -> None:
        if type != "checkpointed" or not data.get("path"):
            self.send(type, data)
            return
        t = threading.Thread(target=self._when_committed, args=(data,), daemon=True)
        t.start()
        self._threads.append(t)

    def _when_committed(self, data: dict[str, Any]) -> None:
        import time

        from backend.proxy import CheckpointStore

        manifest = Path(data["path"]) / "manifest.json"
        deadline = time.monotonic() + self.timeout_s
        while not manifest.exists():
            failed = CheckpointStore.failed_parts(Path(data["path"]))
            if failed or time.monotonic() > deadline:
                why = f"another rank could not write its part: {failed[0]}" if failed else \
                    f"not every rank finished checkpoint {data['path']} within {self.timeout_s:.0f} s"
                self.send("checkpoint_failed", {"error": why, "variables": []})
                return
            time.sleep(0.005)
        try:  # the job's size on disk, all ranks together (rank 0 measured only its own part)
            listed = json.loads(manifest.read_text())
            parts = [*listed.get("files", {}).values(), *listed.get("blobs", {}).values()]
            data = {**data, "bytes": sum(int(f.get("bytes", 0)) for f in parts)}
        except (OSError, ValueError):
            pass
        self.send("checkpointed", data)

    def flush(self) -> None:
        """Wait for pending reports (before the process exits)."""
        for t in self._threads:
            t.join()


def entry() -> None:
    sys.exit(main())
