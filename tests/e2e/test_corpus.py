"""A corpus of training programs in the shapes people write (tests/e2e/programs/corpus/), each
run plainly (``python train.py ARGS`` in a copy of its folder) and as a job on a 2-node cluster
that is preempted and resumed and migrated to the other node at seeded random moments (the DDP
one is also resized 2 -> 1 -> 2 devices with 2 ranks). What it printed (per rank) and every file
it saved must equal the plain run's byte for byte; TensorBoard event files and W&B records,
which carry wall times and host names, are compared by the values read back from them.

Marker ``corpus``: ``-m 'not corpus'`` leaves these out of a quick run.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exactness import (PROGRAMS, files_of, interrupt_at, migrate, preempt_and_resume, random_stops, rank_lines,
                       stdout_lines)
from singularity_sdk import EventType, JobState, LocalCluster

pytestmark = pytest.mark.corpus

CORPUS = PROGRAMS / "corpus"
SLEEP = ["--sleep", "0.2"]  # per step: long enough for an interrupt to land before the end
SEED = int(os.environ.get("CORPUS_SEED", "12"))
MARGIN = 6  # no interrupt is asked for in the last MARGIN printed lines

# program folder -> its arguments (after SLEEP)
SINGLE = {
    "main_argparse": ["--steps", "16", "--lr", "0.03", "--hidden", "12"],
    "trainer_class": ["--epochs", "3"],
    "grad_accumulation": ["--micro-batches", "20", "--accumulate", "4"],
    "lbfgs_closure": ["--steps", "12"],
    "amp_grad_scaler": ["--steps", "16"],
    "infinite_loader": ["--steps", "16", "--workers", "2"],
    "tensorboard_writer": ["--steps", "16"],
    "relative_paths": ["--steps", "16"],
    "sibling_module": ["--steps", "16"],
    "scheduler_manual_update": ["--steps", "16"],
    "random_dataset": ["--epochs", "3"],
    "open_log_files": ["--steps", "16"],
    "global_settings": ["--steps", "16"],
    "config_module": ["--steps", "16"],
    "progress_bars": ["--epochs", "3"],
    "fire_entry": ["--steps", "16"],
    "wandb_offline": ["--epochs", "4", "--batches", "4"],
}
DDP_ARGS = ["--steps", "16"]  # ddp_main, 2 ranks
SPAWN_ARGS = ["--steps", "16", "--world-size", "2"]  # ddp_spawn: mp.spawn of 2 processes
NOT_BITWISE = {"tensorboard_writer": ("runs",),  # compared through the scalars instead
               "wandb_offline": ("wandb",)}  # compared through the rows logged (wandb_records)
THREADS = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # what a worker gets


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path_factory.mktemp("corpus-home")) as cluster, \
            cluster.client() as client:
        yield client


@pytest.fixture(scope="module")
def plain_runs(request, tmp_path_factory):
    """The plain runs of the selected tests, one at a time in the background from the start of
    the module, so they overlap the jobs of the tests before theirs; ``plain_runs(program)``
    waits for one and returns its folder and its output."""
    selected = [item.callspec.params.get("program", "ddp_main") if hasattr(item, "callspec") else "ddp_main"
                for item in request.session.items if item.module is request.module]
    runs = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        for program in dict.fromkeys(selected):
            folder = copy_of(program, tmp_path_factory.mktemp(program) / "plain")
            runs[program] = folder, (pool.submit(plain_torchrun, folder, SLEEP + DDP_ARGS, 2) if program == "ddp_main"
                                     else pool.submit(plain_spawn, folder, SLEEP + SPAWN_ARGS) if program == "ddp_spawn"
                                     else pool.submit(plain_run, folder, SLEEP + SINGLE[program]))
        yield lambda program: (runs[program][0], runs[program][1].result())


def copy_of(program: str, where: Path) -> Path:
    shutil.copytree(CORPUS / program, where, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def plain_run(folder: Path, args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "train.py", *args], cwd=folder, env={**os.environ, **THREADS},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(keepends=True)


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("program", sorted(SINGLE))
def test_program_resumes_exactly_through_preemption_and_migration(two_nodes, plain_runs, tmp_path, program):
    args = SLEEP + SINGLE[program]
    submitted = copy_of(program, tmp_path / "job")
    plain, expected = plain_runs(program)

    job = two_nodes.submit(submitted / "train.py", args=args, workdir=submitted, name=program)
    actions = [preempt_and_resume, migrate, preempt_and_resume, migrate]
    stops = random_stops(SEED + len(program), len(expected) - MARGIN, len(actions))
    assert interrupt_at(job, stops, actions) == len(actions), "the job ended before every interrupt"
    assert job.wait(300) == JobState.SUCCEEDED, job.info.error
    assert stdout_lines(job) == expected

    events = list(job.events(follow=False))
    assert sum(e.type == EventType.PREEMPTED for e in events) >= 2
    nodes = [p["node"] for e in events if e.type == EventType.SCHEDULED for p in e.data["placement"]]
    assert len(nodes) == 1 + len(actions) and set(nodes) == {"node-1", "node-2"}  # it was stopped and moved
    skip = NOT_BITWISE.get(program, ())
    assert files_of(submitted, skip) == files_of(plain, skip)
    assert set(files_of(plain, skip)) - {"train.py", "helpers.py", "data/x.csv", "config.py",
                                                                 "src/mylib.py"}  # it did save something
    if program == "tensorboard_writer":
        expected_scalars = scalars(plain / "runs" / "exp")
        assert len(expected_scalars["train/loss"]) == int(SINGLE[program][1])
        assert scalars(submitted / "runs" / "exp") == expected_scalars
    if program == "wandb_offline":
        from wandb_records import logged

        expected_log, log = logged(plain), logged(submitted)
        assert len(expected_log["rows"]) == 4 and expected_log["summary"]["best_total"] > 0
        assert (log["rows"], log["summary"], log["config"]) == \
            (expected_log["rows"], expected_log["summary"], expected_log["config"])
        assert len(set(log["ids"])) == 1 and len(log["ids"]) >= 3  # one run, continued by each restore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_torchrun(folder: Path, args: list[str], world: int) -> dict[int, list[str]]:
    """What ``torchrun --nproc_per_node WORLD train.py ARGS`` does: one process per rank with the
    rendezvous in its environment; each rank's stdout kept apart."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, **THREADS, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "train.py", *args], cwd=folder, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[rank] = stdout.splitlines(keepends=True)
    return out


def resize_to(gpus: int):
    def resize(job, _i: int) -> None:
        job.resize(gpus, timeout=120)
        assert sum(len(p.devices) for p in job.info.placement) == gpus
    resize.__name__ = f"resize_to_{gpus}"
    return resize


def test_ddp_script_with_its_loop_in_main_resumes_exactly_through_resize_and_migration(two_nodes, plain_runs, tmp_path):
    args = SLEEP + DDP_ARGS
    submitted = copy_of("ddp_main", tmp_path / "job")
    plain, expected = plain_runs("ddp_main")
    total = sum(map(len, expected.values()))

    job = two_nodes.submit(submitted / "train.py", args=args, workdir=submitted, gpus=2, ranks=2, name="ddp-main")
    actions = [resize_to(1), migrate, resize_to(2), preempt_and_resume]
    stops = random_stops(SEED, total - 2 * MARGIN, len(actions))
    assert interrupt_at(job, stops, actions) == len(actions), "the job ended before every interrupt"
    assert job.wait(300) == JobState.SUCCEEDED, job.info.error
    assert rank_lines(job) == expected
    resized = [(e.data["from"], e.data["to"]) for e in job.events(follow=False) if e.type == EventType.RESIZED]
    assert resized == [(2, 1), (1, 2)]
    assert files_of(submitted) == files_of(plain)
    assert "model.pt" in files_of(plain)


def plain_spawn(folder: Path, args: list[str]) -> dict[int, list[str]]:
    """``python train.py ARGS`` for a script that spawns its ranks itself: their lines told apart
    by their ``rank N`` prefix (the processes share one pipe, and ``print`` writes a line and its
    end separately, so lines may be cut by another's); what the parent prints after the spawn
    goes with rank 0, as the job prints it."""
    text = "".join(plain_run(folder, args)).replace("\n", "")
    out: dict[int, list[str]] = {}
    for match in re.finditer(r"rank (\d+) step \d+ loss [-+.\deE]+?(?=rank |all ranks done|$)|all ranks done", text):
        line = match.group(0)
        out.setdefault(int(match.group(1) or 0), []).append(line + "\n")
    return out


@pytest.mark.parametrize("program", ["ddp_spawn"])
def test_a_script_that_spawns_its_ranks_runs_them_as_the_jobs_and_resumes_exactly(two_nodes, plain_runs, tmp_path,
                                                                                   program):
    """mp.spawn(demo_basic, nprocs=2) in a 2-rank job: each rank runs as one spawned process (the
    script's MASTER_PORT and localhost give way to the job's rendezvous, so its ranks meet across
    the two nodes), through a resize and a migration, and the parent's last line comes once."""
    args = SLEEP + SPAWN_ARGS
    submitted = copy_of(program, tmp_path / "job")
    plain, expected = plain_runs(program)
    assert sum(line == "all ranks done\n" for lines in expected.values() for line in lines) == 1

    job = two_nodes.submit(submitted / "train.py", args=args, workdir=submitted, gpus=2, name=program)
    actions = [resize_to(1), migrate, resize_to(2)]
    stops = random_stops(SEED + 1, sum(map(len, expected.values())) - 2 * MARGIN, len(actions))
    assert interrupt_at(job, stops, actions) == len(actions), "the job ended before every interrupt"
    assert job.wait(300) == JobState.SUCCEEDED, job.info.error
    assert rank_lines(job) == expected
    assert files_of(submitted) == files_of(plain) and "model.pt" in files_of(plain)

    other = copy_of(program, tmp_path / "four")
    wrong = two_nodes.submit(other / "train.py", args=["--steps", "2", "--world-size", "4"], workdir=other, gpus=2,
                             name="spawn-4-in-2-ranks")
    assert wrong.wait(120) == JobState.FAILED
    assert "spawn(nprocs=4) in a job of 2 ranks" in wrong.info.error and "--ranks 4" in wrong.info.error
