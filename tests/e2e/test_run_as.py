"""``serve --run-as``: each user's jobs run as that user's own OS account, inside the sandbox.

Two throwaway system accounts stand in for two people. A job runs with its account's uid and
gid, writes its files as that account, survives a preemption (its checkpoint folder is its
account's), and a file one user's job keeps private (0600, outside the service's home) is out
of the other user's reach, which it was not while every job ran as the service's user. A user
missing from the table cannot submit; a bad table stops `serve` before it starts.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from backend.agent import accounts, sandbox
from backend.server.run_as import RunAsTableError, read_table
from singularity_sdk import JobState, LocalCluster
from processes import started_as, until_workers_fork
from singularity_sdk.errors import APIError

ACCOUNTS = {"alice": "sg-test-alice", "bob": "sg-test-bob"}


def _why_not() -> str:
    if os.geteuid() != 0:
        return "running jobs as OS accounts needs root (the agent switches accounts)"
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        return "useradd and setpriv are needed to make the test's accounts"
    if sandbox.choose() is None:
        return "no working bwrap here (make setup installs bubblewrap)"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")


@pytest.fixture(scope="module")
def os_accounts():
    made = []
    for name in ACCOUNTS.values():
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            made.append(name)
    try:
        found = {user: accounts.lookup(name) for user, name in ACCOUNTS.items()}
        why = accounts.refusal(ACCOUNTS["alice"], sandboxed=True)
        if why:
            pytest.skip(why)  # e.g. this checkout lies under a folder the accounts cannot enter
        yield found
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def cluster(os_accounts, tmp_path_factory):
    base = tmp_path_factory.mktemp("run-as")
    table = base / "run-as.table"
    table.write_text("# user  account\nalice sg-test-alice\nbob: sg-test-bob   # a comment\n")
    with LocalCluster(nodes=1, devices_per_node=2, home=base / "home", sandbox="bwrap", run_as=table) as c:
        with httpx.Client(base_url=c.url + "/api/v1", headers={"Authorization": f"Bearer {c.token}"}) as h:
            tokens = {user: h.post("/users", json={"user": user}).json()["token"] for user in ACCOUNTS}
        yield c, tokens


COUNTER = """\
import os, time
print("ids", os.getuid(), os.getgid(), flush=True)
with open("mine.txt", "w") as f:
    f.write("x")
print("owner", os.stat("mine.txt").st_uid, flush=True)
total = 0
for i in range(60):
    total += i
    time.sleep(0.05)
print("total", total)
"""


def test_a_job_runs_as_its_users_account_and_resumes_as_it(cluster, os_accounts):
    c, tokens = cluster
    alice = os_accounts["alice"]
    folder = c.home.parent / "alice-folder"  # the folder alice submits from: her own
    folder.mkdir()
    os.chown(folder, alice.uid, alice.gid)
    with c.client(tokens["alice"]) as client:
        job = client.submit(COUNTER, name="counter", workdir=folder)
        while "ids" not in job.logs():
            assert job.refresh().state in (JobState.QUEUED, JobState.RUNNING), job.logs()
            time.sleep(0.1)
        job.preempt(timeout=120)
        ckpt = c.home / "checkpoints"
        owners = {p.stat().st_uid for p in ckpt.rglob("*") if job.id in str(p)}
        assert owners == {alice.uid}, owners  # the checkpoint was written by the job's account
        job.resume()
        assert job.wait(120) == JobState.SUCCEEDED, job.logs()
        lines = job.logs().splitlines()
    assert f"ids {alice.uid} {alice.gid}" in lines
    assert f"owner {alice.uid}" in lines and (folder / "mine.txt").stat().st_uid == alice.uid
    assert lines[-1] == f"total {sum(range(60))}"


def test_one_users_private_file_is_out_of_the_other_users_reach(cluster):
    c, tokens = cluster
    secret = Path("/tmp") / f"sg-test-{uuid.uuid4().hex}"
    keep = (f"import os\nfd = os.open({str(secret)!r}, os.O_WRONLY | os.O_CREAT, 0o600)\n"
            f"os.write(fd, b'alice only')\nos.close(fd)\n")
    peek = (f"try:\n    print(open({str(secret)!r}).read())\nexcept PermissionError:\n"
            f"    print('denied')\n")
    try:
        with c.client(tokens["alice"]) as a, c.client(tokens["bob"]) as b:
            if sandbox.forks_can_sandbox() is None:
                until_workers_fork(a)  # forks of the warm spawner switch accounts themselves
            assert a.submit(keep, name="keep").wait(120) == JobState.SUCCEEDED
            bobs = b.submit(peek, name="peek")
            assert bobs.wait(120) == JobState.SUCCEEDED
            assert bobs.logs().strip() == "denied"
            own = a.submit(peek, name="own")
            assert own.wait(120) == JobState.SUCCEEDED
            assert own.logs().strip() == "alice only"
            if sandbox.forks_can_sandbox() is None:
                assert started_as(bobs) == started_as(own) == {"0": "fork+sandbox"}
    finally:
        secret.unlink(missing_ok=True)


def test_a_user_without_an_account_cannot_submit(cluster):
    c, _ = cluster
    with c.client() as admin, pytest.raises(APIError) as refused:
        admin.submit("print(1)")
    assert refused.value.status == 403
    assert "no OS account" in str(refused.value) and "--run-as" in str(refused.value)


def test_a_bad_table_is_refused_naming_the_line(tmp_path):
    table = tmp_path / "t"
    table.write_text("alice sg-test-alice\nbob\n")
    with pytest.raises(RunAsTableError, match="line 2"):
        read_table(table)
    table.write_text("alice Not/An/Account\n")
    with pytest.raises(RunAsTableError, match="line 1"):
        read_table(table)
    done = subprocess.run([sys.executable, "-m", "backend", "serve", "--home", str(tmp_path / "h"), "--run-as",
                           str(table)], capture_output=True, text=True, timeout=60,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert done.returncode != 0 and "line 1" in done.stderr, done.stderr


def test_giving_a_folder_to_an_account_hands_over_nothing_else(os_accounts, tmp_path):
    """A job (as its account) may leave links in its folders for the next attempt's chown, run by
    root: links are not followed, and a file with a second name (a hard link to someone else's
    file) is left alone."""
    alice = os_accounts["alice"]
    victim = tmp_path / "victim"
    victim.write_text("root's")
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "own.txt").write_text("x")
    os.link(victim, folder / "hard")
    os.symlink(victim, folder / "soft")
    accounts.give(alice, [folder])
    assert (folder / "own.txt").stat().st_uid == alice.uid and folder.stat().st_uid == alice.uid
    assert victim.stat().st_uid == 0 and os.lstat(folder / "soft").st_uid == alice.uid
