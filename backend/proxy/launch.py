"""Start a job's W ranks on this machine the way torchrun does, under the proxy's backend.

    python -m backend.proxy.launch [--threads N] [--reduction exact|plain]
                                   [--checkpoint-dir D [--restore]] SCRIPT [script args]

runs SCRIPT as ``__main__`` in *this* process, as one rank, after `collectives.install()` and
after fixing torch's thread counts (intra-op thread counts change float results, so a rank gets
the same count wherever it runs).  With ``--checkpoint-dir`` the script runs under the
resumable engine with a `DistributedController`: checkpoints are agreed by all ranks, exit code
75 means "stopped after a consistent checkpoint", and ``--restore`` creates the process group
before loading the newest checkpoint (`rank.run_rank`, which the service's worker runs too).

`launch()` starts W such processes with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus
``SINGULARITY_PLACEMENT``; the tests and the benchmark use it.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from backend.contract import ENV_CPUS, ENV_PLACEMENT, ENV_THREADS, EXIT_PREEMPTED, with_hash_seed
from backend.forkserver import ForkedProcess, ForkServer

from .distributed.layout import RankLayout

#: test hook "RANK:SECONDS:THEN": that rank alone asks for a checkpoint after SECONDS; with
#: "@STEP" for SECONDS, at its first safe point of that step or later (however slow the machine)
TEST_REQUEST_ENV = "SINGULARITY_TEST_REQUEST"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slot_cpus(placement: RankLayout, per_slot: int, cpus: Optional[Sequence[int]] = None) -> list[list[int]]:
    """CPU cores of each slot: ``per_slot`` consecutive cores per slot (a CPU slot is a "device")."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if per_slot * len(placement.slots) > len(cpus):
        raise ValueError(f"{len(placement.slots)} slots of {per_slot} cores need more than the {len(cpus)} cores here")
    return [cpus[i * per_slot:(i + 1) * per_slot] for i in range(len(placement.slots))]


def rank_env(rank: int, placement: RankLayout, master_port: int, master_addr: str = "127.0.0.1",
             threads: int = 1, cpus: Optional[Sequence[int]] = None) -> dict[str, str]:
    """torchrun's variables for one logical rank, plus placement, thread count and CPU cores."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(placement.world_size), "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(master_port), ENV_PLACEMENT: placement.text(), ENV_THREADS: str(threads),
           "OMP_NUM_THREADS": str(threads)}
    env.update(placement.local_env(rank))
    if cpus is not None:
        env[ENV_CPUS] = ",".join(str(c) for c in cpus)
    return env


@dataclass
class RankResult:
    rank: int
    rc: int
    stdout: str
    stderr: str


#: what a warm rank process is forked from (`backend.forkserver` preloads what it needs:
#: torch and what DDP's constructor imports lazily, 0.8 s per process)
WARM_TARGET = "backend.proxy.launch"
_SHARED: list[ForkServer] = []


def shared_warm_server() -> ForkServer:
    """One warm server per process (tests and benchmarks share it), closed at exit."""
    if not _SHARED:
        _SHARED.append(ForkServer([WARM_TARGET]))
        atexit.register(_SHARED[0].close)
    return _SHARED[0]


class _Proc:
    """A rank: a subprocess (output in pipes) or a child of a `ForkServer` (output in files)."""

    def __init__(self, proc: Union[subprocess.Popen, ForkedProcess], files: Optional[tuple[str, str]] = None) -> None:
        self.proc, self.files = proc, files

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def collect(self) -> tuple[int, str, str]:
        if self.files is None:
            assert isinstance(self.proc, subprocess.Popen)
            out, err = self.proc.communicate()
            return self.proc.returncode, out, err
        rc = self.proc.wait()
        texts = [Path(f).read_text(errors="replace") if Path(f).exists() else "" for f in self.files]
        return rc, texts[0], texts[1]


def launch(script: Path, placement: RankLayout, args: Sequence[str] = (), env: Optional[dict[str, str]] = None,
           timeout: float = 120.0, threads: int = 1, reduction: Optional[str] = None,
           warm: Optional[ForkServer] = None, launcher_args: Sequence[str] = (),
           cpus_per_slot: Optional[int] = None, python: str = sys.executable) -> list[RankResult]:
    """Run ``script`` as W rank processes; if one fails the others are stopped after a grace period.

    With ``warm``, ranks are forked from that server, which has already imported torch (each
    rank is still its own process): tests and benchmarks save ~2 s of imports per rank.
    """
    import tempfile

    port = free_port()
    extra = dict(env or {})
    argv = ["--threads", str(threads)] + (["--reduction", reduction] if reduction else []) + list(launcher_args) \
        + [str(script), *args]
    procs: list[_Proc] = []
    tmp = tempfile.TemporaryDirectory(prefix="sg-ranks-")
    cores = slot_cpus(placement, cpus_per_slot) if cpus_per_slot else None
    for rank in range(placement.world_size):
        full = with_hash_seed(dict(os.environ))
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full.get("PYTHONPATH", "")) if p)
        full.update(extra)
        full.update(rank_env(rank, placement, port, threads=threads,
                             cpus=cores[placement.slot_of(rank)] if cores else None))
        if warm is not None:
            files = (f"{tmp.name}/{rank}.out", f"{tmp.name}/{rank}.err")
            procs.append(_Proc(warm.start(WARM_TARGET, argv, full, str(ROOT), *files), files))
        else:
            procs.append(_Proc(subprocess.Popen(
                [python, "-m", "backend.proxy.launch", *argv], env=full, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, cwd=str(ROOT))))
    deadline = time.monotonic() + timeout
    failed_at: Optional[float] = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.02)
    try:
        return [RankResult(rank, *p.collect()) for rank, p in enumerate(procs)]
    finally:
        tmp.cleanup()


def say_line(text: str) -> None:
    """A plain ``[proxy] ...`` line on stderr (what `say` writes, without the JSON)."""
    sys.stderr.write(f"[proxy] {text}\n")
    sys.stderr.flush()


def say(kind: str, data: Any) -> None:
    """A diagnostic for the launching process: one ``[proxy] KIND JSON`` line on stderr (the
    wire format of both ``python -m backend.proxy`` and this launcher; stdout is the script's).
    Written to the stream, not through ``print``: a script may replace ``builtins.print`` (one
    that prints on rank 0 only, or adds a prefix), and the lines must still reach the launcher."""
    sys.stderr.write(f"[proxy] {kind} {json.dumps(data, default=str)}\n")
    sys.stderr.flush()


def _run_engine(script: str, checkpoint_dir: Path, restore: bool) -> int:
    """Run the script as a resumable program whose checkpoints are agreed by all ranks."""
    from . import CheckpointError, CheckpointStore, Preempted, ResumableProgram
    from .rank import RankRun, main_namespace, run_rank

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    namespace = main_namespace(script)
    program = ResumableProgram.from_source(Path(script).read_text(), script)
    run = RankRun(CheckpointStore(checkpoint_dir), rank, world, restore=restore, on_event=say)

    def before(run: RankRun) -> None:
        if run.restored is not None:
            say("restore", {"checkpoint": str(run.restored.path), "step": run.restored.step})
        hook = os.environ.get(TEST_REQUEST_ENV, "")
        if hook:
            who, delay, then = hook.split(":")
            if int(who) == rank and delay.startswith("@"):
                run.controller.checkpoint_at_step(int(delay[1:]), then)  # type: ignore[union-attr]
            elif int(who) == rank:
                timer = threading.Timer(float(delay), run.controller.request_checkpoint,  # type: ignore[union-attr]
                                        kwargs={"then": then, "reason": "test"})
                timer.daemon = True
                timer.start()

    try:
        run_rank(program, namespace, run, before)
    except Preempted as p:
        say("stopped", {"step": p.checkpoint.step, "path": str(p.checkpoint.path)})
        return EXIT_PREEMPTED
    except CheckpointError as e:
        say_line(f"restore failed: {e}")
        return 2
    say("finished", {"step": run.controller.last_step if run.controller else 0})
    return 0


def pin_to_slot() -> None:
    """Run on the cores of this rank's slot (``SINGULARITY_CPUS``), if it was given some; threads
    and processes started afterwards (DataLoader workers) inherit them."""
    cpus = os.environ.get(ENV_CPUS, "")
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])


def prepare_rank(threads: Optional[int] = None, reduction: Optional[str] = None) -> None:
    """Make this process one rank of a job: a fixed torch thread count (intra-op thread counts
    change float results, so a rank gets the same count wherever it runs), and the proxy's
    collective backend in place of the one the code will ask for."""
    if threads is None:
        threads = int(os.environ.get(ENV_THREADS, "1") or 1)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed in this process
        pass
    from .distributed.collectives import install

    install(reduction)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.proxy.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get(ENV_THREADS, "1") or 1))
    parser.add_argument("--reduction", choices=("exact", "plain"))
    parser.add_argument("--checkpoint-dir", type=Path, help="run under the resumable engine, checkpointing here")
    parser.add_argument("--restore", action="store_true", help="with --checkpoint-dir: resume the newest checkpoint")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.script is None:
        parser.error("SCRIPT is required")
    pin_to_slot()
    prepare_rank(ns.threads, ns.reduction)
    script = str(Path(ns.script).resolve())
    sys.argv = [script, *ns.args]
    sys.path.insert(0, str(Path(script).parent))
    if ns.checkpoint_dir is not None:
        return _run_engine(script, ns.checkpoint_dir, ns.restore)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
