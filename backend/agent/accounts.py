"""Jobs that run as their user's own OS account (``serve --run-as``), as JupyterHub's spawners do.

Without it every job runs as the service's OS user: inside the sandbox it cannot reach the
service's files, but it can read and write whatever that user can elsewhere, other users'
submitted folders and files in ``/tmp`` included. With a ``--run-as`` table the server names,
in each start, the account the job's user maps to, and the agent (which must run as root)
starts the job's workers as that account: the folders the job writes in (its run folder, its
checkpoint folder, the synced copy of its folder) are given to the account first, and inside
the sandbox ``setpriv`` sets the account's uid, gid and groups before the worker starts, with
no new privileges. The sandbox is required: the run folder lives under the agent's home (0700,
often under /root): the sandbox covers the folders on the way that the account could not pass
through anyway (`out_of_reach`) and mounts the job's own folders back, and Python and this
package read-only (`code_folders`).
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Account:
    """An OS account jobs run as: its ids, supplementary groups and home."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def env(self) -> dict[str, str]:
        """What a login as the account would set: a job's caches go to its own home."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def ids(self) -> dict[str, Any]:
        """What a fork switches to (`backend.namespaces.enter`): uid, gid and groups."""
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)}

    def become(self) -> list[str]:
        """The command prefix that runs the rest as this account (setpriv, from util-linux)."""
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return [shutil.which("setpriv") or "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", groups,
                "--no-new-privs", "--"]


def lookup(name: str) -> Account:
    """The account called ``name`` on this machine (KeyError, with what to do, if there is none)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise KeyError(f"there is no OS account {name!r} on this node: create it (useradd {name}), or map the "
                       f"user to another account in serve's --run-as table") from None
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return Account(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def _passable(account: Account, st: os.stat_result) -> bool:
    """Whether ``account`` may pass through a folder with this status (its x bit for them)."""
    if st.st_uid == account.uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == account.gid or st.st_gid in account.groups:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def out_of_reach(account: Account, paths: Iterable[Path]) -> list[Path]:
    """The folders on the way to ``paths`` that ``account`` cannot pass through: the sandbox
    covers them (their contents were out of its reach anyway) and mounts ``paths`` back."""
    found = set()
    for path in paths:
        for folder in reversed(Path(path).resolve().parents[:-1]):  # from the top down, '/' excluded
            if not _passable(account, os.stat(folder)):
                found.add(folder)
                break
    return sorted(found)


def refusal(name: str, sandboxed: bool) -> Optional[str]:
    """Why this node cannot run a job as account ``name``, or None."""
    if os.geteuid() != 0:
        return (f"the job must run as OS account {name!r} (serve --run-as), but this node's agent does not run "
                f"as root, so it cannot switch accounts; run the agent as root")
    if not sandboxed:
        return (f"the job must run as OS account {name!r} (serve --run-as), which needs the sandbox, and this "
                f"node has none: install bubblewrap (apt-get install bubblewrap)")
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed on this node; jobs cannot switch to their OS accounts"
    try:
        account = lookup(name)
    except KeyError as exc:
        return str(exc.args[0])
    return None


def code_folders() -> list[Path]:
    """What a worker runs: the Python installation (and its virtual environment) and the folder
    this package is imported from. The sandbox mounts them back, read-only, where they lie under
    a folder the account cannot enter (a Python under /root)."""
    found = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(__file__).resolve().parents[2]}
    return sorted(p for p in found if not any(q != p and q in p.parents for q in found))


def give(account: Account, folders: Iterable[Path]) -> None:
    """Make ``folders`` and everything in them the account's (a restored checkpoint, a synced
    copy from an earlier attempt), so its workers can write where the job writes.

    Links are never followed, and a file with more than one name is left as it is: an earlier
    attempt of the job (as the account) could have made a hard link to a file of someone else's
    there, which a chown by root would hand over."""
    for folder in folders:
        if not folder.exists():
            continue
        os.chown(folder, account.uid, account.gid, follow_symlinks=False)
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                path = os.path.join(root, name)
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    continue
                os.chown(path, account.uid, account.gid, follow_symlinks=False)

