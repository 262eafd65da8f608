"""Stop at seeded random safe points, resume in a new process each time: stdout must match exactly."""
from __future__ import annotations

import runpy
import sys

import pytest

from harness import SCRIPTS, pick_stops, run_chain, trace_of


def _check(launcher, target, tmp_path, seed, extra=2, env=None):
    base, trace = trace_of(launcher, target, tmp_path, env)
    stops = pick_stops(trace, seed, extra)
    out, runs = run_chain(launcher, target, stops, tmp_path / "ck", env)
    assert out.splitlines() == base.stdout.splitlines(), f"stops {stops}"
    assert not list((tmp_path / "ck").glob("ckpt-*")), "a finished job clears its checkpoints"
    return base, trace, stops, runs


@pytest.mark.parametrize("workers,seed", [("0", 11), ("2", 12)])
def test_dataloader_training_resumes_exactly(launcher, tmp_path, workers, seed):
    target = [str(SCRIPTS / "train_loader.py")]
    base, trace, stops, runs = _check(launcher, target, tmp_path, seed, env={"NUM_WORKERS": workers})
    assert len(stops) >= 5
    assert any("loss" in line for line in base.stdout.splitlines())


def test_dataloader_training_fresh_interpreters(fresh_launcher, tmp_path):
    """The same, with every run a brand-new interpreter rather than a fork of a warm one."""
    target = [str(SCRIPTS / "train_loader.py")]
    base, trace = trace_of(fresh_launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    stops = sorted({loops[len(loops) // 3], loops[2 * len(loops) // 3]})
    out, _ = run_chain(fresh_launcher, target, stops, tmp_path / "ck")
    assert out.splitlines() == base.stdout.splitlines(), f"stops {stops}"


@pytest.mark.parametrize("seed", [21, 22])
def test_control_flow_and_rng_resume_exactly(launcher, tmp_path, seed):
    _check(launcher, [str(SCRIPTS / "misc.py"), "--print-result"], tmp_path, seed, extra=3)


def build_callable_job(path):
    """Pickle the job the way the SDK does: a function defined in __main__, by value."""
    argv = sys.argv
    sys.argv = ["callable_job.py", str(path)]
    try:
        runpy.run_path(str(SCRIPTS / "callable_job.py"), run_name="__main__")
    finally:
        sys.argv = argv


def test_callable_resumes_exactly(launcher, tmp_path):
    job = tmp_path / "job.pkl"
    build_callable_job(job)
    base, trace, stops, runs = _check(launcher, [str(job), "--callable", "--print-result"], tmp_path, seed=31)
    assert base.stdout.splitlines()[-1] == runs[-1].stdout.splitlines()[-1]  # the return value
    assert any(t["kind"] == "loop" for t in trace), "the callable's own loops are safe points"
