"""A job's worker runs where it sees neither the service's files nor other processes.

Jobs run as the service's OS user, so file modes alone cannot keep a job from reading
``state.db``, ``server.json``, the agents' credentials, other jobs' ``spec.json`` or, through
``/proc``, other processes' environments and command lines. Each worker is therefore started in
Linux namespaces with bubblewrap (``bwrap``), chosen over ``unshare`` or hand-written namespace
code because it needs no privileges where user namespaces are allowed, and it already does the
parts that are easy to get wrong (mount propagation, a reaping pid 1, dying with its parent):

- a new PID namespace with its own ``/proc``: the job sees only its own processes;
- the service's home, the agent's home and the checkpoint root are covered by empty tmpfs
  mounts, and only this attempt's own folders are mounted back (its run folder, its checkpoint
  folder, its synced copy); the folder it was submitted from stays where it is;
- its own ``/dev/shm``, mode 1777 as on a host (DataLoader workers share tensors through it,
  other jobs do not see it);
- of the GPUs' device files (``/dev/nvidiaN``) only its own: the others are covered by a
  read-only bind of ``/dev/null`` (bwrap mounts it ``nodev``, so opening one fails with
  EACCES), so a job cannot reach another job's GPU even by resetting ``CUDA_VISIBLE_DEVICES``;
  the shared control files (``nvidiactl``, ``nvidia-uvm``) stay, CUDA needs them;
- everything else (the Python installation, the network) as on the host.

``SINGULARITY_SANDBOX``: ``auto`` (default: bwrap when it works here, else no sandbox and a
warning), ``bwrap`` (required: a worker does not start without it), ``off``. Once the warm
spawner is ready, a worker is a fork of it that makes the same sandbox itself
(`backend.namespaces`, from the same `plan`), where `forks_can_sandbox` says that works here;
until then, and where it does not, a sandboxed worker is a fresh interpreter under bwrap.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Optional

from singularity_sdk.config import SANDBOX_ENV, TOKEN_ENV

from . import accounts
from .accounts import Account
from .credential import JOIN_ENV
from .credential import TOKEN_ENV as AGENT_TOKEN_ENV

log = logging.getLogger("singularity.agent")

MODE_ENV = SANDBOX_ENV
MODES = ("auto", "bwrap", "off")
#: Variables a worker never inherits from its agent: credentials of the service.
SECRET_ENV = (TOKEN_ENV, AGENT_TOKEN_ENV, JOIN_ENV)
#: The umask jobs get (the service's own files are created 0600 under umask 077).
JOB_UMASK_ENV = "SINGULARITY_JOB_UMASK"


class SandboxUnavailable(RuntimeError):
    """``SINGULARITY_SANDBOX=bwrap`` was asked for and bwrap cannot run here."""


@functools.lru_cache(maxsize=None)
def _bwrap_works(bwrap: str) -> Optional[str]:
    """None when ``bwrap`` can make the namespaces we use here, else why not."""
    try:
        done = subprocess.run([bwrap, "--die-with-parent", "--unshare-pid", "--dev-bind", "/", "/",
                               "--proc", "/proc", "--tmpfs", "/dev/shm", "--", "true"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.decode(errors="replace").strip()


@functools.lru_cache(maxsize=None)
def forks_can_sandbox() -> Optional[str]:
    """None when a fork of the warm spawner can make its own sandbox here (`backend.namespaces`:
    the kernel allows the namespaces and mounts it needs), else why not."""
    try:
        done = subprocess.run([sys.executable, "-m", "backend.namespaces"], capture_output=True, timeout=30,
                              cwd=Path(__file__).resolve().parents[2])
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"


def choose(mode: Optional[str] = None) -> Optional[str]:
    """The bwrap executable to sandbox workers with, or None (no sandbox)."""
    mode = (mode or os.environ.get(MODE_ENV) or "auto").lower()
    if mode not in MODES:
        raise SandboxUnavailable(f"{MODE_ENV}={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return None
    bwrap = shutil.which("bwrap")
    why = "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)" if bwrap is None \
        else _bwrap_works(bwrap)
    if why is None:
        return bwrap
    if mode == "bwrap":
        raise SandboxUnavailable(f"{MODE_ENV}=bwrap but {why}")
    log.warning("jobs run WITHOUT a sandbox: %s. A job can then read the service's files; see "
                "docs/security.md", why)
    return None


#: a GPU's own device file; N is its minor number (NVML's ``nvmlDeviceGetMinorNumber``)
_GPU_FILE = re.compile(r"nvidia(\d+)")


def gpu_files_to_mask(own: Optional[Collection[int]], dev: Path = Path("/dev")) -> list[Path]:
    """The GPU device files under ``dev`` a job must not open: every ``nvidiaN`` whose N is not
    among ``own`` (the minor numbers of the job's GPUs on this node). None: nothing is masked
    (the minor numbers are unknown here, and masking blindly could hide the job's own GPU)."""
    if own is None:
        return []
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return sorted(dev / n for n in names if (m := _GPU_FILE.fullmatch(n)) and int(m.group(1)) not in own)


@dataclass(frozen=True)
class Mount:
    """One step of a sandbox's file system, in order: ``tmpfs`` (cover a folder with an empty
    one), ``dir`` (make a folder inside a cover), ``bind`` / ``ro-bind`` (mount a path back at
    the same place), ``mask`` (a read-only, ``nodev`` /dev/null over a device file)."""

    kind: str
    path: str
    #: permissions of a ``tmpfs`` or ``dir`` (None: 0755)
    mode: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        """The form `backend.namespaces.enter` takes (it travels in a fork server request)."""
        return {"kind": self.kind, "path": self.path, **({"mode": self.mode} if self.mode is not None else {})}


def plan(hidden: Iterable[Path], visible: Iterable[Path], masked: Iterable[Path] = (),
         account: Optional[Account] = None) -> list[Mount]:
    """A worker's file system: its own ``/dev/shm``, ``hidden`` folders covered, ``visible``
    ones (inside them) mounted back, ``masked`` device files made unopenable.

    With ``account`` (accounts.py) the folders on the way to the visible ones and to Python and
    this package that it cannot pass are covered too, and Python and this package are mounted
    back read-only (an interpreter under /root). bwrap (`command`) and a fork of the warm
    spawner (`backend.namespaces`) both make exactly this."""
    mounts = [Mount("tmpfs", "/dev/shm", 0o1777)]
    visible = sorted({Path(p).resolve() for p in visible if Path(p).exists()})
    unreachable: list[Path] = []
    binds: list[tuple[str, Path]] = []
    if account is not None:
        code = accounts.code_folders()
        unreachable = accounts.out_of_reach(account, [*visible, *code])
        binds += [("ro-bind", path) for path in code]
    covered = _outermost([*unreachable, *hidden])
    binds += [("bind", path) for path in visible]
    mounts += [Mount("tmpfs", str(path)) for path in covered]
    for kind, path in binds:
        if account is not None:  # the folders made on the way are 0700: let the account pass
            for folder in reversed(path.parents):
                if any(c == folder or c in folder.parents for c in covered):
                    mounts.append(Mount("dir", str(folder), 0o755))
        mounts.append(Mount(kind, str(path)))
    return mounts + [Mount("mask", str(path)) for path in masked]


def command(bwrap: str, argv: list[str], mounts: Iterable[Mount], info_fd: int,
            account: Optional[Account] = None) -> list[str]:
    """``argv`` in a bwrap sandbox made of ``mounts`` (`plan`), as ``account`` if given; the
    sandbox's pid is written to ``info_fd`` as JSON ``{"child-pid": N}``, and it leads its own
    process group (signal that one, not bwrap's)."""
    out = [bwrap, "--die-with-parent", "--unshare-pid", "--new-session", "--info-fd", str(info_fd),
           "--dev-bind", "/", "/", "--proc", "/proc"]
    for m in mounts:
        if m.mode is not None:
            out += ["--perms", f"{m.mode:04o}"]
        out += {"tmpfs": ["--tmpfs", m.path], "dir": ["--dir", m.path], "bind": ["--bind", m.path, m.path],
                "ro-bind": ["--ro-bind", m.path, m.path], "mask": ["--ro-bind", os.devnull, m.path]}[m.kind]
    return out + ["--", *(account.become() if account is not None else []), *argv]


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """Existing folders among ``paths``, without those inside another one."""
    found = sorted({Path(p).resolve() for p in paths if Path(p).is_dir()}, key=lambda p: len(p.parts))
    keep: list[Path] = []
    for p in found:
        if not any(p == k or k in p.parents for k in keep):
            keep.append(p)
    return keep


def exit_code(code: int) -> int:
    """bwrap reports a worker killed by signal N as 128 + N; say it as Popen does (-N)."""
    return -(code - 128) if 128 < code < 128 + 65 and code - 128 in signal.valid_signals() else code


def job_umask() -> int:
    """The umask a job's files are created with (the one ``serve`` was started with)."""
    try:
        return int(os.environ.get(JOB_UMASK_ENV, "022"), 8)
    except ValueError:
        return 0o022
