"""A fork of the warm spawner makes its job's sandbox itself (backend/namespaces.py), from the
same plan bwrap gets: the hidden folder is covered and the job's own mounted back, /proc shows
the sandbox's processes only, a masked device file cannot be opened, /dev/shm is its own, no
capability is left (so no cover can be taken off), and the exit code is bwrap's."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend import forkserver
from backend.agent import sandbox

pytestmark = pytest.mark.skipif(sandbox.forks_can_sandbox() is not None,
                                reason=f"no namespaces for a forked sandbox here: {sandbox.forks_can_sandbox()}")

PROBE = r'''
import ctypes, json, os, sys
found = {"pid": os.getpid(), "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
def attempt(what, fn):
    try:
        fn()
        found[what] = "ok"
    except OSError as exc:
        found[what] = type(exc).__name__
attempt("secret", lambda: open(sys.argv[1]).read())
attempt("own_file", lambda: open("own.txt", "w").write("written inside"))
attempt("masked", lambda: open("/dev/zero", "rb").read(1))
attempt("unmasked", lambda: open("/dev/urandom", "rb").read(1))
found["shm_before"] = sorted(os.listdir("/dev/shm"))
attempt("shm", lambda: open("/dev/shm/mine", "w").write("x"))
libc = ctypes.CDLL(None, use_errno=True)
found["umount"] = libc.umount2(os.path.dirname(os.path.dirname(sys.argv[1])).encode(), 2)  # MNT_DETACH
found["cap_eff"] = next(l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff"))
found["no_new_privs"] = next(l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs"))
print("PROBE " + json.dumps(found))
if len(sys.argv) > 2:
    os.kill(os.getpid(), int(sys.argv[2]))
'''


@pytest.fixture(scope="module")
def server():
    fs = forkserver.ForkServer(["backend.proxy.__main__"])
    yield fs
    fs.close()


def _run(server: forkserver.ForkServer, tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    home = tmp_path / "service-home"  # what the job must not see: a secret beside the job's folder
    job = home / "runs" / "job-1"
    job.mkdir(parents=True)
    (home / "runs" / "secret.txt").write_text("token")
    (job / "probe.py").write_text(PROBE)
    mounts = sandbox.plan([home], [job], masked=[Path("/dev/zero")])
    marker = Path(f"/dev/shm/singularity-test-{os.getpid()}")  # the host's, which it must not see
    marker.write_text("")
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**os.environ, "SINGULARITY_SANDBOXED": "1"}
    proc = server.start("backend.proxy.__main__",
                        [str(job / "probe.py"), "--checkpoint-dir", str(job / "ckpt"), "--",
                         str(home / "runs" / "secret.txt"), *extra],
                        env, str(job), str(out), str(err),
                        sandbox={"mounts": [m.as_dict() for m in mounts], "account": None})
    try:
        rc = proc.wait(120)
    finally:
        marker.unlink()
    line = next((ln for ln in out.read_text().splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, err.read_text()
    return rc, json.loads(line[6:]), err.read_text()


def test_a_forked_worker_is_as_confined_as_a_bwrap_one(server, tmp_path):
    rc, found, err = _run(server, tmp_path)
    assert rc == 0, err
    assert found["pid"] == 2 and found["processes"] == [1, 2]  # its init and itself
    assert found["secret"] == "FileNotFoundError"  # covered
    assert found["own_file"] == "ok" and (tmp_path / "service-home/runs/job-1/own.txt").read_text() == "written inside"
    assert found["masked"] == "PermissionError" and found["unmasked"] == "ok"
    assert found["shm"] == "ok" and found["shm_before"] == []  # its own, empty /dev/shm
    assert not Path("/dev/shm/mine").exists()
    assert found["umount"] != 0  # the covers cannot be taken off
    assert int(found["cap_eff"], 16) == 0 and found["no_new_privs"] == "1"


def test_a_signal_ends_it_with_bwraps_exit_code(server, tmp_path):
    rc, found, _ = _run(server, tmp_path, str(int(signal.SIGTERM)))
    assert rc == 128 + signal.SIGTERM
    assert sandbox.exit_code(rc) == -signal.SIGTERM


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to become nobody")
def test_an_agent_that_is_not_root_gets_it_through_a_user_namespace():
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "backend.namespaces"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"this kernel gives unprivileged users no namespaces: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
