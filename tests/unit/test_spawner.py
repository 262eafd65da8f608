"""The warm spawner: forked workers must behave like fresh interpreters (own session, working
directory, environment, thread count, RNG seeds, exit codes) and see nothing of the zygote."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from backend.agent.spawner import Spawner
from backend.forkserver import ForkServer

PROBE = r'''
import json, os, sys, numpy, torch
fds = []
for f in os.listdir("/proc/self/fd"):
    try:
        fds.append(os.readlink("/proc/self/fd/" + f))
    except OSError:  # the directory handle listdir itself used
        pass
print(json.dumps({"cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("PROBE"),
                  "sid": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads(),
                  "np": numpy.random.rand(), "fds": fds, "umask": os.umask(0o022)}), flush=True)
if os.environ.get("PROBE") == "die":
    os.kill(os.getpid(), 9)
'''


async def _run(spawner: Spawner, tmp: Path, name: str, env_extra: dict[str, str]) -> tuple[dict, int]:
    rank_dir = tmp / name
    rank_dir.mkdir()
    spec = rank_dir / "spec.json"
    spec.write_text(json.dumps({"source": PROBE, "filename": "<probe>"}))
    r, w = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": "2", **env_extra}
    proc = await spawner.spawn([str(spec), str(rank_dir)], env, str(rank_dir), w, 1 << 20)
    os.close(w)
    os.close(r)
    assert proc is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return json.loads(line), await asyncio.wait_for(proc.wait(), 30)


def test_forked_workers_look_fresh_and_report_exit_codes(tmp_path):
    async def main() -> None:
        spawner = Spawner()
        await spawner.start()
        for _ in range(600):
            if spawner.ready:
                break
            await asyncio.sleep(0.05)
        assert spawner.ready, "the zygote did not come up"
        (a, rc_a), (b, rc_b) = [await _run(spawner, tmp_path, n, {"PROBE": n, **umask})
                                      for n, umask in (("a", {}), ("b", {"SINGULARITY_JOB_UMASK": "027"}))]
        dead, rc_dead = await _run(spawner, tmp_path, "die", {"PROBE": "die"})
        await spawner.close()
        assert (rc_a, rc_b, rc_dead) == (0, 0, -signal.SIGKILL)
        assert a["cwd"] == a["path0"] == str(tmp_path / "a") and a["env"] == "a"
        assert a["sid"] and a["threads"] == 2
        assert (a["umask"], b["umask"]) == (0o022, 0o027), "the job's umask, not the service's"
        assert a["np"] != b["np"], "numpy's global RNG must be seeded again in each child"
        assert not [f for f in a["fds"] if f.startswith("socket:")], f"the zygote's socket leaked: {a['fds']}"

    asyncio.run(main())


def test_the_sync_client_runs_registered_targets_only(tmp_path):
    """The launcher's and the tests' client of the same server: a target from the registry runs
    as ``python -m`` would (rc as Popen's), anything else is refused before any fork."""
    server = ForkServer([])  # preloads nothing: this checks the protocol, not the warmth
    try:
        out, err = tmp_path / "out", tmp_path / "err"
        child = server.start("backend.proxy.launch", ["--help"], dict(os.environ), str(tmp_path), str(out), str(err))
        assert child.wait(60) == 0 and "usage" in out.read_text(), err.read_text()
        with pytest.raises(RuntimeError):
            server.start("os", ["-c", "print(1)"], dict(os.environ), str(tmp_path), str(out), str(err))
    finally:
        server.close()


def test_a_child_runs_its_own_exit_finalizers_and_not_the_servers(tmp_path):
    """The server's finalizers (torch's operator libraries, its temporary folders) do not run
    in each child's exit, where they cost ~60 ms of CPU per job; a job's own still do."""
    import subprocess
    import sys

    code = ("import weakref\n"
            "from backend.forkserver import _exit_finalizers_stay_here\n"
            "class Thing: pass\n"
            "before = Thing(); weakref.finalize(before, print, 'the server s')\n"
            "_exit_finalizers_stay_here()  # what the server does before its first fork\n"
            "after = Thing(); weakref.finalize(after, print, 'the job s')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split("\n") == ["the job s", ""], out.stderr
