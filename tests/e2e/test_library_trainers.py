"""Loops that live in a library: Hugging Face transformers' ``Trainer.train()`` (rewritten by
default) and a trainer module outside the job's folder (rewritten when the job names it).

* A tiny Trainer job (a few hundred parameters, an in-memory dataset, CPU, seeded) is
  preempted and resumed and migrated at seeded random moments on a 2-node cluster: its printed
  losses and the hash of its final weights equal a plain ``python train.py`` run's.
* The same program through the local CLI stops at seeded random safe points that lie inside
  the library's frames (``Trainer.train`` -> ``_inner_training_loop`` -> ...), each stop
  restored by a new process, with the same output as a plain run.
* A job whose loop is in ``mini_trainer.fit`` (a module on PYTHONPATH, not in its folder): a
  preempt answers ``checkpoint_failed`` naming that library function, and the job runs on;
  submitted with ``rewrite_modules=["mini_trainer"]`` it is preempted and migrated exactly.

Marker ``corpus`` (a few minutes). The transformers tests skip when transformers (with
accelerate) is not installed: ``pip install -e '.[trainers]'``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exactness import (PROGRAMS, files_of, interrupt_at, migrate, preempt_and_resume, random_stops, stdout_lines,
                       wait_for_lines)
from singularity_sdk import EventType, JobState, LocalCluster
from singularity_sdk.errors import CheckpointFailed

pytestmark = pytest.mark.corpus

TRAINERS = PROGRAMS / "trainers"
SEED = int(os.environ.get("CORPUS_SEED", "12"))
THREADS = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # what a worker gets
REPO = Path(__file__).resolve().parents[2]


def _transformers_missing() -> str:
    """Why the transformers tests cannot run ("" when they can); found without importing them (slow)."""
    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not importable: pip install -e '.[trainers]'" if missing else ""


needs_transformers = pytest.mark.skipif(bool(_transformers_missing()), reason=_transformers_missing() or "-")

HF_ARGS = ["--epochs", "3", "--accumulate", "2"]


def _copy(program: str, where: Path) -> Path:
    shutil.copytree(TRAINERS / program, where, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def _plain(folder: Path, args: list[str], env: dict | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "train.py", *args], cwd=folder, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **THREADS, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(keepends=True)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path_factory.mktemp("trainers-home")) as cluster, \
            cluster.client() as client:
        yield client


@needs_transformers
def test_transformers_trainer_job_resumes_exactly_through_preemption_and_migration(two_nodes, tmp_path):
    args = ["--sleep", "0.2"] + HF_ARGS
    plain = _copy("hf_trainer", tmp_path / "plain")
    expected = _plain(plain, args)
    assert expected[-1].startswith("weights ") and len(expected) > 12

    submitted = _copy("hf_trainer", tmp_path / "job")
    job = two_nodes.submit(submitted / "train.py", args=args, workdir=submitted, name="hf-trainer")
    actions = [preempt_and_resume, migrate, preempt_and_resume]
    stops = random_stops(SEED, len(expected) - 4, len(actions))
    assert interrupt_at(job, stops, actions) == len(actions), "the job ended before every interrupt"
    assert job.wait(600) == JobState.SUCCEEDED, job.info.error
    assert stdout_lines(job) == expected  # every loss, and the final weights' hash

    events = list(job.events(follow=False))
    preempted = [e for e in events if e.type == EventType.PREEMPTED]
    assert len(preempted) >= 2
    nodes = [p["node"] for e in events if e.type == EventType.SCHEDULED for p in e.data["placement"]]
    assert len(nodes) == 1 + len(actions) and set(nodes) == {"node-1", "node-2"}
    assert files_of(submitted) == files_of(plain)


def _proxy(folder: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.proxy", "train.py", "--checkpoint-dir", "ck", *extra],
                          cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **THREADS, "PYTHONPATH": str(REPO), **(env or {})})


@needs_transformers
def test_transformers_trainer_stops_inside_the_library_loop_and_resumes_exactly(tmp_path):
    plain = _copy("hf_trainer", tmp_path / "plain")
    expected = "".join(_plain(plain, HF_ARGS))

    traced = _copy("hf_trainer", tmp_path / "traced")
    run = _proxy(traced, "--trace", "trace.jsonl", "--", *HF_ARGS)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected
    inside = [p["step"] for p in map(json.loads, (traced / "trace.jsonl").read_text().splitlines())
              if "_inner_training_loop" in p.get("functions", ())]
    assert inside, "no safe point inside Trainer's loop"
    stops = sorted(random.Random(SEED).sample(inside[:-1], 3))

    job = _copy("hf_trainer", tmp_path / "job")
    out = ""
    for i, step in enumerate(stops):
        run = _proxy(job, *(["--restore"] if i else []), "--stop-at-step", str(step), "--", *HF_ARGS)
        assert run.returncode == 75, run.stderr
        assert f'"step": {step}' in run.stderr
        out += run.stdout
    # the position is in transformers' own statements: another version of it refuses the restore
    other = {"SINGULARITY_FINGERPRINT_OVERRIDE": json.dumps({"libraries": {"transformers": "0.0.1-other"}})}
    refused = _proxy(job, "--restore", "--", *HF_ARGS, env=other)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert "transformers " in refused.stderr and "(checkpoint) vs 0.0.1-other (here)" in refused.stderr
    run = _proxy(job, "--restore", "--", *HF_ARGS)
    assert run.returncode == 0, run.stderr
    assert out + run.stdout == expected


# --------------------------------------------------------------------------- a module named by the job
BOUND = 2.0


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """One node whose server bounds every move at BOUND seconds, so an unreachable safe point is answered."""
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path_factory.mktemp("h"),
                      checkpoint_timeout=BOUND) as cluster, cluster.client() as client:
        yield client


def test_a_loop_in_a_library_module_is_reported_unless_the_job_names_the_module(bounded, tmp_path):
    lib = str(TRAINERS / "lib")
    env = {"PYTHONPATH": lib, "STEPS": "30", "STEP_SLEEP": "0.2"}
    plain = _copy("uses_library", tmp_path / "plain")
    expected = _plain(plain, [], env)

    # not named: no safe point inside mini_trainer.fit, and the answer says where the job is
    folder = _copy("uses_library", tmp_path / "unnamed")
    job = bounded.submit(folder / "train.py", workdir=folder, env=env, name="unnamed")
    wait_for_lines(job, 3)
    with pytest.raises(CheckpointFailed, match=r"train\.py:\d+ in <module>, inside mini_trainer\.fit"):
        job.preempt(timeout=90)
    assert job.refresh().state == JobState.RUNNING
    job.cancel()

    # named: preempted and migrated inside the library's loop, exactly
    folder = _copy("uses_library", tmp_path / "named")
    job = bounded.submit(folder / "train.py", workdir=folder, env=env, name="named", rewrite_modules=["mini_trainer"])
    actions = [preempt_and_resume, migrate]
    stops = random_stops(SEED, len(expected) - 4, len(actions))
    assert interrupt_at(job, stops, actions) == len(actions), "the job ended before every interrupt"
    assert job.wait(300) == JobState.SUCCEEDED, job.info.error
    assert stdout_lines(job) == expected
    assert sum(e.type == EventType.PREEMPTED for e in job.events(follow=False)) >= 1
