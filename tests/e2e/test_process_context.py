"""The process context travels with a job: argv, its folder, sibling modules, chdir, env changes.

A real training script (argparse ``-- ARGS``, relative data and output paths, a sibling module,
an ``os.chdir()`` and an ``os.environ`` change before its loop) is preempted, resumed and migrated
at seeded random moments; what it printed and every file it wrote must equal, byte for byte, a
plain ``python train.py ARGS`` run of the same folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exactness import PROGRAMS, preempt_and_resume, random_stops, stdout_lines, wait_for_lines
from singularity_sdk import JobState, LocalCluster
from singularity_sdk.errors import InvalidRequest

ARGS = ["--steps", "40", "--lr", "0.05", "--run", "runs/first try", "--sleep", "0.03"]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def plain_run(folder: Path) -> list[str]:
    """``python train.py ARGS`` in ``folder``, with the thread count a worker gets."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "train.py", *ARGS], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=180, check=True).stdout
    return out.splitlines(keepends=True)


def _node_of(job) -> str:
    return job.refresh().placement[0].node


def migrate(job, _i: int) -> None:
    there = "node-2" if _node_of(job) == "node-1" else "node-1"
    job.migrate(there, timeout=60)


@pytest.mark.parametrize("seed", [int(os.environ.get("CONTEXT_SEED", "11"))])
def test_script_with_args_files_and_chdir_resumes_exactly(tmp_path, seed):
    plain, submitted = tmp_path / "plain", tmp_path / "submitted"
    shutil.copytree(PROGRAMS / "script_job", plain)
    shutil.copytree(PROGRAMS / "script_job", submitted)
    expected = plain_run(plain)
    assert expected[-1] == "saved runs/first try\n"

    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h") as cluster, cluster.client() as client:
        job = client.submit(submitted / "train.py", args=ARGS, workdir=submitted, name="script")
        interrupts = [preempt_and_resume, migrate, preempt_and_resume, migrate]
        for i, target in enumerate(random_stops(seed, len(expected), len(interrupts))):
            wait_for_lines(job, target)
            if job.refresh().state.is_terminal:
                break
            interrupts[i](job, i)
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert stdout_lines(job) == expected
        moved = {e.data.get("attempt") for e in job.events(follow=False) if e.type.value == "scheduled"}
        assert len(moved) >= 3  # it really was stopped and started again
    assert files_of(submitted) == files_of(plain)


def test_synced_copy_and_its_files_follow_the_job_between_nodes_without_shared_disks(tmp_path):
    """Nodes that do not use the submitter's folder run the job in a copy sent with it; the
    files the job writes there travel in its checkpoints through the store to the next node."""
    plain, submitted = tmp_path / "plain", tmp_path / "submitted"
    shutil.copytree(PROGRAMS / "script_job", plain)
    shutil.copytree(PROGRAMS / "script_job", submitted)
    expected = plain_run(plain)
    before = files_of(submitted)
    store = f"file://{tmp_path / 'store'}"
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", store=store,
                      env={"SINGULARITY_SHARED_WORKDIRS": "0"}) as cluster, cluster.client() as client:
        job = client.submit(submitted / "train.py", args=ARGS, workdir=submitted, sync_workdir=True, name="synced")
        for i, target in enumerate(random_stops(7, len(expected), 3)):
            wait_for_lines(job, target)
            if job.refresh().state.is_terminal:
                break
            (migrate if i != 1 else preempt_and_resume)(job, i)
        assert job.wait(180) == JobState.SUCCEEDED, job.info.error
        assert stdout_lines(job) == expected
        last = _node_of(job)
        copy = cluster.home / "agents" / last / "workdirs" / job.id
        assert files_of(copy) == files_of(plain)
    assert files_of(submitted) == before  # the submitter's folder was not used


def test_a_folder_over_the_cap_is_refused_before_upload(tmp_path, client):
    (tmp_path / "train.py").write_text("print(1)\n")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(33 * 2**20)
    with pytest.raises(InvalidRequest, match=r"32 MiB.*largest file: big.bin"):
        client.submit(tmp_path / "train.py", workdir=tmp_path, sync_workdir=True)


def test_args_must_be_strings_and_workdir_absolute(client):
    with pytest.raises(InvalidRequest, match=r"args.*list of strings.*str\(\)"):
        client.submit("print(1)", args=["--steps", 3])
    with pytest.raises(InvalidRequest, match="list of strings"):
        client.submit("print(1)", args="--steps 3")
    with pytest.raises(InvalidRequest, match="not an absolute path"):  # the SDK sends absolute ones
        client._post("/jobs", {"source": "print(1)", "workdir": "relative/folder"})
    with pytest.raises(InvalidRequest, match="list of strings"):  # the server checks as well
        client._post("/jobs", {"source": "print(1)", "args": [1]})


LOCAL_RANKS = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("gpus", [4, 2])
def test_local_rank_numbers_the_jobs_ranks_on_each_node(client, gpus):
    """torchrun's meaning: LOCAL_RANK counts this job's ranks on the rank's node from 0, and
    LOCAL_WORLD_SIZE is how many there are (4 ranks on 4 devices over 2 nodes, or 2 devices)."""
    job = client.submit(LOCAL_RANKS, gpus=gpus, ranks=4, name=f"local-ranks-{gpus}")
    assert job.wait(180) == JobState.SUCCEEDED, job.info.error
    seen = {}
    for line in stdout_lines(job):
        rank, local, local_world = map(int, line.split())
        seen[rank] = (local, local_world)
    expected = {}
    for p in job.info.placement:
        for i, rank in enumerate(sorted(p.ranks)):
            expected[rank] = (i, len(p.ranks))
    assert seen == expected and sorted(seen) == [0, 1, 2, 3]
    if gpus == 4:
        assert len(job.info.placement) == 2  # both nodes took part


def test_cli_submit_passes_args_after_double_dash_and_runs_in_the_current_folder(cluster, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "show.py").write_text(
        "import os, sys\nfrom sibling import WORD\nprint(sys.argv[1:], WORD, os.path.basename(os.getcwd()))\n"
        "open('written.txt', 'w').write('kept')\n")
    (tmp_path / "sub" / "sibling.py").write_text("WORD = 'imported'\n")
    env = {**os.environ, "SINGULARITY_HOME": str(cluster.home)}
    env.pop("SINGULARITY_URL", None)
    env.pop("SINGULARITY_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "singularity_sdk.cli", "submit", "sub/show.py", "--wait", "--",
                           "--lr", "0.1", "--", "two words"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "['--lr', '0.1', '--', 'two words'] imported " + tmp_path.name in proc.stdout
    assert (tmp_path / "written.txt").read_text() == "kept"  # relative to where it was submitted
