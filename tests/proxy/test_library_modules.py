"""Loops in a library module (not the program's file or folder) get safe points when the job
names the module (``SINGULARITY_REWRITE_MODULES``; transformers' Trainer is in the default list,
tests/e2e/test_library_trainers.py): stopped at seeded random safe points inside the library's
frames, each restore in a new process, the run prints bitwise what plain Python prints. The
library reaches its loop through a ``functools.partial`` and a method call spanning lines, as
transformers' ``Trainer.train`` does."""
from __future__ import annotations

import os
import random
import subprocess

from backend.proxy.engine import libraries
from harness import PYTHON, ROOT, SCRIPTS, run_chain, trace_of

HERE = SCRIPTS / "libraries"
SCRIPT = str(HERE / "uses_steplib.py")


def _env(named: bool) -> dict[str, str]:
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{HERE / 'lib'}", "OMP_NUM_THREADS": "1"}
    env[libraries.ENV] = "steplib" if named else ""
    return env


def _plain() -> str:
    out = subprocess.run([PYTHON, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, **_env(False)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_named_library_module_stops_inside_its_loop_and_resumes_exactly(fresh_launcher, tmp_path):
    env = _env(named=True)
    base, trace = trace_of(fresh_launcher, [SCRIPT], tmp_path, env)
    assert base.stdout == _plain()
    inside = [t["step"] for t in trace if t.get("functions") == ["fit", "_run", "run_epoch"]]
    assert len(inside) == 3 * (5 + 1), trace  # per batch, and before each epoch ends: through the partial and the multi-line call
    assert any(t.get("functions") == ["fit", "_run"] for t in trace)
    # each stop after the first is taken after a restore re-entered the library's frames
    stops = sorted(random.Random(11).sample(inside[:-1], 3))
    out, _ = run_chain(fresh_launcher, [SCRIPT], stops, tmp_path / "ck", env)
    assert out == base.stdout, f"stops {stops}"


def test_an_unnamed_library_module_has_no_safe_point_inside(fresh_launcher, tmp_path):
    base, trace = trace_of(fresh_launcher, [SCRIPT], tmp_path, _env(named=False))
    assert base.stdout == _plain()
    assert trace and all(t["kind"] == "boundary" for t in trace)


def test_the_module_list():
    assert libraries.modules_from_env("") == list(libraries.DEFAULT_MODULES)
    assert libraries.modules_from_env("a.b, c") == [*libraries.DEFAULT_MODULES, "a.b", "c"]
    assert libraries.modules_from_env("-,c") == ["c"]
    bases = {libraries.base_of(n) for n in ("transformers.trainer", "steplib", "lightning.pytorch.loops.fit_loop")}
    assert len(bases) == 3 and min(bases) >= libraries.SPAN
