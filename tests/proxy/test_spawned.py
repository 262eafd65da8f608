"""``torch.multiprocessing.spawn`` in a job (spawned.py): the statement becomes a call of the
spawned function as this rank's process, so its loops are the job's safe points; the shapes it
does not cover run as written. (tests/e2e/test_corpus.py runs the DDP tutorial's shape as a
2-rank job through a resize and a migration.)"""
from __future__ import annotations

import ast

import pytest

from backend.proxy import CheckpointStore, Controller, ResumableProgram
from backend.proxy.engine import spawned
from backend.proxy.engine.library_patches import imported_names


def _rewritten(src: str) -> str:
    tree = ast.parse(src)
    spawned.rewrite(tree, imported_names(tree))
    return ast.unparse(tree)


@pytest.mark.parametrize("src", [
    "import torch.multiprocessing as mp\nmp.spawn(work, args=(2, cfg), nprocs=2, join=True)",
    "import torch\ntorch.multiprocessing.spawn(work, (2, cfg), 2)",
    "from torch.multiprocessing import spawn\nspawn(work, args=(2, cfg), nprocs=2)",
    "from torch import multiprocessing as tmp\ntmp.start_processes(work, (2, cfg), 2, start_method='spawn')",
])
def test_a_joined_spawn_statement_becomes_a_call_of_its_function_as_this_ranks_process(src):
    lines = _rewritten(src).splitlines()
    assert lines[1:4] == ["if __sg_rt__.spawns_ranks(2):",
                          "    __sg_rt__.spawn_joined(work(__sg_rt__.spawned_rank(), *(2, cfg)))", "else:"]
    assert lines[4] == "    " + src.splitlines()[1]  # a one-rank job that spawns helpers spawns them


@pytest.mark.parametrize("src", [
    "import torch.multiprocessing as mp\nmp.spawn(work, nprocs=2, join=False)",  # the caller joins later
    "import torch.multiprocessing as mp\nctx = mp.spawn(work, nprocs=2)",  # its value is used
    "import torch.multiprocessing as mp\nmp.spawn(self.work, nprocs=2)",  # not a name of the program
    "import multiprocessing as mp\nmp.spawn(work, nprocs=2)",  # not torch's
    "import torch.multiprocessing as mp\nmp.spawn(*job)",
])
def test_other_shapes_run_as_written(src):
    assert _rewritten(src) == ast.unparse(ast.parse(src))


def test_the_number_of_processes_must_be_the_jobs_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert spawned.spawns_ranks(2) and spawned.rank_of_spawned() == 1
    with pytest.raises(RuntimeError, match=r"spawn\(nprocs=4\) in a job of 2 ranks.*--ranks 4"):
        spawned.spawns_ranks(4)


def test_a_one_rank_job_that_spawns_helpers_spawns_them_with_a_warning(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.warns(RuntimeWarning, match=r"spawn\(nprocs=3\) in a one-rank job .*`--ranks 3`"):
        assert spawned.spawns_ranks(3) is False


def test_the_spawned_function_runs_in_this_process_with_its_loops_as_safe_points(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    src = ("import torch.multiprocessing as mp\nseen = []\n"
           "def work(rank, n):\n    for i in range(n):\n        seen.append((rank, i))\n"
           "if __name__ == '__main__':\n    mp.spawn(work, args=(3,), nprocs=1)\n    seen.append('after')\n")
    steps: list = []
    ctl = Controller(CheckpointStore(tmp_path / "ck"))
    ctl.trace_safe_points(lambda step, where: steps.append(where))
    namespace = {"__name__": "__main__"}
    ResumableProgram.from_source(src, "<spawn>").run(namespace, ctl)
    assert namespace["seen"] == [(0, 0), (0, 1), (0, 2), "after"]
    assert [w.get("functions") for w in steps if w["kind"] == "loop"] == [["work"]] * 4


def test_a_scripts_own_rendezvous_gives_way_to_the_jobs(monkeypatch):
    """The tutorial's ``MASTER_PORT=12355`` and the ImageNet example's ``tcp://224.66.41.62:23456``
    put every job on one port of one host; the job's own address and port are used instead."""
    from backend.proxy.distributed import collectives

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    arguments = {"backend": "gloo", "init_method": "tcp://224.66.41.62:23456", "rank": 1, "world_size": 2}
    collectives._job_rendezvous(arguments, "127.0.0.1:41234")
    assert arguments == {"backend": "gloo", "init_method": "tcp://127.0.0.1:41234", "rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match=r"init_process_group\(world_size=4\) in rank 1 of a job of 2 rank"):
        collectives._job_rendezvous({"world_size": 4}, "127.0.0.1:41234")
