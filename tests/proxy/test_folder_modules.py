"""Loops in a helper module beside the script (``from helpers import Trainer``) are the user's
loops: safe points inside them by default, stops at seeded random ones resume exactly, and
``SINGULARITY_REWRITE_FOLDER=0`` turns it off."""
from __future__ import annotations

import os
import random
import subprocess

from backend.proxy.engine import libraries
from harness import PYTHON, ROOT, SCRIPTS, run_chain, trace_of

SCRIPT = str(SCRIPTS / "folder_modules" / "uses_helpers.py")


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _plain() -> str:
    out = subprocess.run([PYTHON, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, **_env()})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_helper_module_beside_the_script_stops_inside_its_loop_and_resumes_exactly(fresh_launcher, tmp_path):
    base, trace = trace_of(fresh_launcher, [SCRIPT], tmp_path, _env())
    assert base.stdout == _plain()
    inside = [t["step"] for t in trace if t.get("functions") == ["run_epoch"]]
    assert len(inside) == 3 * (4 + 1), trace  # per batch, and once more as each epoch's loop ends
    stops = sorted(random.Random(7).sample(inside[:-1], 3))
    out, _ = run_chain(fresh_launcher, [SCRIPT], stops, tmp_path / "ck", _env())
    assert out == base.stdout, f"stops {stops}"


def test_the_folder_rewrite_can_be_turned_off(fresh_launcher, tmp_path):
    base, trace = trace_of(fresh_launcher, [SCRIPT], tmp_path, _env(**{libraries.FOLDER_ENV: "0"}))
    assert base.stdout == _plain()
    assert trace and not any(t.get("functions") for t in trace)
