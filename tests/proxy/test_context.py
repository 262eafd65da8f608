"""The process context module on its own: what a checkpoint records and what a restore redoes."""
from __future__ import annotations

import os
import pickle
import sys

import pytest

from backend.proxy.engine import context
from backend.proxy.checkpoint.errors import CheckpointError, CheckpointFailure
from singularity_sdk import folders as files


@pytest.fixture()
def job_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1"])
    monkeypatch.setenv("KEPT", "1")
    monkeypatch.setenv("DROPPED", "1")
    context.begin()
    yield tmp_path
    context.carry_files(None)


def test_cwd_is_relative_to_the_job_folder_and_env_changes_are_the_jobs_only(job_folder, monkeypatch):
    (job_folder / "runs" / "a").mkdir(parents=True)
    os.chdir("runs/a")
    os.environ["PHASE"] = "fit"
    os.environ["RANK"] = "7"  # the service's: a restore takes the new attempt's value
    del os.environ["DROPPED"]
    ctx = context.capture()
    assert (ctx["cwd"], ctx["cwd_relative"]) == (os.path.join("runs", "a"), True)
    ctx["set"].pop("PYTEST_CURRENT_TEST", None)  # pytest's own, changed between setup and call
    assert ctx["set"] == {"PHASE": "fit"} and ctx["unset"] == ["DROPPED"]
    assert context.carried_folder() is None  # a folder the nodes share does not travel

    # a new process on another node: the same folder at another path, the service's environment
    other = job_folder.parent / (job_folder.name + "-elsewhere")
    (other / "runs" / "a").mkdir(parents=True)
    os.chdir(other)
    monkeypatch.setenv("DROPPED", "1")
    monkeypatch.delenv("PHASE")
    monkeypatch.setenv("RANK", "0")
    sys.argv[:] = ["train.py"]
    context.begin()
    context.restore(ctx)
    assert os.getcwd() == str(other / "runs" / "a")
    assert os.environ["PHASE"] == "fit" and "DROPPED" not in os.environ and os.environ["RANK"] == "0"
    assert sys.argv == ["train.py", "--lr", "0.1"]


def test_a_missing_cwd_is_a_clear_restore_error(job_folder):
    (job_folder / "gone").mkdir()
    os.chdir("gone")
    ctx = context.capture()
    os.chdir(job_folder)
    (job_folder / "gone").rmdir()
    with pytest.raises(CheckpointError, match="'gone' inside the job's folder.*does not exist"):
        context.restore(ctx)


def test_a_synced_copy_is_rolled_back_to_the_checkpoints_files(job_folder):
    (job_folder / "out").mkdir()
    (job_folder / "out" / "a.txt").write_text("before")
    (job_folder / "empty").mkdir()
    context.carry_files(str(job_folder))
    saved = pickle.dumps(context.carried_folder())
    (job_folder / "out" / "a.txt").write_text("after the checkpoint")
    (job_folder / "out" / "b.txt").write_text("new")
    (job_folder / "empty").rmdir()
    assert pickle.loads(saved) is None  # loading the checkpoint rolls the copy back
    assert sorted(str(p.relative_to(job_folder)) for p in job_folder.rglob("*")) == ["empty", "out", "out/a.txt"]
    assert (job_folder / "out" / "a.txt").read_text() == "before"


def test_a_copy_over_the_cap_fails_the_checkpoint_naming_the_cap(job_folder):
    with open(job_folder / "big.bin", "wb") as f:
        f.truncate(files.MAX_WORKDIR_BYTES + 1)  # sparse: the size check comes before any read
    context.carry_files(str(job_folder))
    with pytest.raises(CheckpointFailure, match=r"limited to 32 MiB \(largest file: big.bin"):
        context.carried_folder()
