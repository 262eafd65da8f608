"""Helpers for the subprocess tests: launching CLI runs, reading their events, stop chains."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
PYTHON = sys.executable
from backend.contract import EXIT_PREEMPTED  # noqa: F401  (the tests import it from here)
from backend.forkserver import ForkedProcess, ForkServer

#: what the warm launcher forks: ``python -m backend.proxy``'s main
CLI_TARGET = "backend.proxy.__main__"


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str

    def events(self, kind: Optional[str] = None) -> list[tuple[str, dict]]:
        """``[proxy] kind {json}`` lines of stderr."""
        out = []
        for line in self.stderr.splitlines():
            if not line.startswith("[proxy] "):
                continue
            name, _, payload = line[len("[proxy] "):].partition(" ")
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            if kind is None or name == kind:
                out.append((name, data))
        return out

    def describe(self) -> str:
        return f"rc={self.rc}\n--- stdout tail ---\n{self.stdout[-1500:]}\n--- stderr tail ---\n{self.stderr[-3000:]}"


class Launcher:
    """Runs ``python -m backend.proxy ARGS`` as a fresh interpreter or forked from a warm server
    (`backend.forkserver`, which imported torch once: ~1.4 s saved per run; every run is still
    its own process, so a checkpoint is always restored by another process than its writer)."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self._tmp = tempfile.TemporaryDirectory(prefix="proxy-runs-")
        self._n = 0
        self._lock = threading.Lock()
        self._server = None if fresh else ForkServer([CLI_TARGET], env=self._env({}))

    @staticmethod
    def _env(extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra)
        return env

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._tmp.cleanup()

    def start(self, args: list[str], env: Optional[dict[str, str]] = None) -> "Handle":
        with self._lock:
            self._n += 1
            base = Path(self._tmp.name) / f"run{self._n}"
        out, err = base.with_suffix(".out"), base.with_suffix(".err")
        if self.fresh:
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen([PYTHON, "-m", "backend.proxy", *args], cwd=ROOT,
                                        env=self._env(env or {}), stdout=fo, stderr=fe)
            return Handle(self, proc.pid, out, err, proc)
        assert self._server is not None
        forked = self._server.start(CLI_TARGET, args, self._env(env or {}), str(ROOT), str(out), str(err))
        return Handle(self, forked.pid, out, err, forked)

    def run(self, args: list[str], env: Optional[dict[str, str]] = None, timeout: float = 120) -> Run:
        return self.start(args, env).wait(timeout)


@dataclass
class Handle:
    launcher: Launcher
    pid: int
    out: Path
    err: Path
    proc: Union[subprocess.Popen, ForkedProcess]

    def stderr_so_far(self) -> str:
        return self.err.read_text() if self.err.exists() else ""

    def wait(self, timeout: float = 120) -> Run:
        rc = self.proc.wait(timeout=timeout)
        return Run(rc, self.out.read_text(), self.err.read_text())


# --------------------------------------------------------------------------- stop chains
def _after(script_args: Sequence[str]) -> list[str]:
    return ["--", *script_args] if script_args else []


def trace_of(launcher: Launcher, target: list[str], tmp: Path, env: Optional[dict[str, str]] = None,
             script_args: Sequence[str] = ()) -> tuple[Run, list[dict]]:
    """The uninterrupted run (under the engine) and its list of safe points."""
    trace = tmp / "trace.jsonl"
    run = launcher.run(target + ["--checkpoint-dir", str(tmp / "ck-base"), "--trace", str(trace)]
                       + _after(script_args), env)
    assert run.rc == 0, run.describe()
    return run, [json.loads(line) for line in trace.read_text().splitlines()]


_UNINTERRUPTED: dict[tuple, tuple[str, list[dict]]] = {}


def uninterrupted(launcher: Launcher, key: str, target: list[str], tmp: Path,
                  check: Optional[Callable[[str], None]] = None,
                  script_args: Sequence[str] = ()) -> tuple[str, list[dict]]:
    """What `trace_of` prints and traces, run once per ``key`` in a test process: the tests that
    stop one program at several seeds' stops share its uninterrupted run (it does not depend on
    where a chain will stop). ``check`` is asked once about the stdout (e.g. against plain python)."""
    if key not in _UNINTERRUPTED:
        run, trace = trace_of(launcher, target, tmp, script_args=script_args)
        if check is not None:
            check(run.stdout)
        _UNINTERRUPTED[key] = (run.stdout, trace)
    return _UNINTERRUPTED[key]


def loop_steps(trace: list[dict], source: str, header: str) -> list[int]:
    """The safe points at the top of the loop whose line of ``source`` starts with ``header``."""
    line = next(i for i, x in enumerate(source.splitlines(), 1) if x.startswith(header))
    return [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == line]


def pick_stops(trace: list[dict], seed: int, extra: int) -> list[int]:
    """First iteration, a stop between two loops, the last iterations, plus ``extra`` random ones."""
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    between = [t["step"] for prev, t in zip(trace, trace[1:])
               if t["kind"] == "boundary" and prev["kind"] == "loop"
               and any(u["kind"] == "loop" for u in trace if u["step"] > t["step"])]
    chosen = {loops[0], loops[-1], loops[-2]}
    rng = random.Random(seed)
    if between:
        chosen.add(rng.choice(between))
    steps = [t["step"] for t in trace]
    target = min(len(steps), len(chosen) + extra)
    while len(chosen) < target:
        chosen.add(rng.choice(steps))
    return sorted(chosen)


def run_chain(launcher: Launcher, target: list[str], stops: list[int], ckdir: Path,
              env: Optional[dict[str, str]] = None, script_args: Sequence[str] = (),
              deferred: bool = False) -> tuple[str, list[Run]]:
    """Stop at each step of ``stops`` in turn (each run restoring the previous checkpoint);
    ``deferred``: each stop must come later than asked (a graph still to be used was held)."""
    runs = []
    at = None
    for i, step in enumerate(stops):
        args = target + ["--checkpoint-dir", str(ckdir), "--stop-at-step", str(step)]
        run = launcher.run(args + (["--restore"] if i else []) + _after(script_args), env)
        assert run.rc == EXIT_PREEMPTED, f"stop at {step}: {run.describe()}"
        stopped = [d for _, d in run.events("stopped")]
        assert stopped and (stopped[0]["step"] > step if deferred else stopped[0]["step"] == step), run.describe()
        if i:
            restored = [d for _, d in run.events("restore")]
            assert restored and restored[0]["step"] == at, run.describe()
        at = stopped[0]["step"]
        runs.append(run)
    final = launcher.run(target + ["--checkpoint-dir", str(ckdir), "--restore"] + _after(script_args), env)
    assert final.rc == 0, final.describe()
    runs.append(final)
    return "".join(r.stdout for r in runs), runs


def assert_resumes_at_iterations(launcher: Launcher, source: str, tmp_path: Path, iterations: Sequence[int]) -> None:
    """``source`` as a script, stopped at the top of the given loop iterations (indices into its
    loop safe points) in turn: the chain prints what the uninterrupted run prints."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(script)], [loops[i] for i in iterations], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()


def assert_chains_match(launcher: Launcher, target: list[str], base: Run, trace: list, ckroot: Path,
                        seeds: tuple = (1, 2, 3), extra: int = 3) -> None:
    """For each seed, a chain of random stops (`pick_stops`) ends with the uninterrupted run's stdout."""
    for seed in seeds:
        stops = pick_stops(trace, seed, extra=extra)
        out, runs = run_chain(launcher, target, stops, ckroot / f"ck-{seed}")
        assert out == base.stdout, f"seed {seed}, stops {stops}\n{runs[-1].describe()}"
