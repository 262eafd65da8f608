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


LOGUTIL = '''
import logging, os
print("logging to train.log")                      # top-level code with effects: it runs once
logger = logging.getLogger("exp")
logger.setLevel(logging.INFO)
logger.addHandler(logging.FileHandler(os.path.join(os.path.dirname(__file__), "train.log"), mode="w"))
logger.info("configured")
'''

LOGGED_TRAINING = '''
from logutil import logger

def main():
    total = 0
    for epoch in range(8):
        total += epoch * epoch
        logger.info("epoch %d total %d", epoch, total)
        print("epoch", epoch, total)

if __name__ == "__main__":
    main()
'''


def test_a_helper_modules_top_level_code_does_not_run_again_at_a_restore(launcher, tmp_path):
    """A restore imports the job's modules afresh: a print at a helper's top level printed again at
    each restore, and its ``FileHandler("train.log", mode="w")`` truncated the log after the
    load had put its contents back (the restored handler then wrote NUL bytes before its lines)."""
    folders = {}
    for name in ("plain", "base", "chain"):
        folder = folders[name] = tmp_path / name
        folder.mkdir()
        (folder / "logutil.py").write_text(LOGUTIL)
        (folder / "train.py").write_text(LOGGED_TRAINING)
    plain = subprocess.run([PYTHON, "train.py"], cwd=folders["plain"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.count("logging to") == 1
    log = (folders["plain"] / "train.log").read_text()
    base, trace = trace_of(launcher, [str(folders["base"] / "train.py")], tmp_path)
    assert base.stdout == plain.stdout and (folders["base"] / "train.log").read_text() == log
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(folders["chain"] / "train.py")], [loops[1], loops[4], loops[6]],
                          tmp_path / "ck")
    assert out == plain.stdout, runs[-1].describe()
    assert (folders["chain"] / "train.log").read_text() == log
