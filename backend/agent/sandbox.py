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
warning), ``bwrap`` (required: a worker does not start without it), ``off``. A sandboxed
worker starts as a fresh interpreter: a fork of the warm spawner would share its namespaces.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Collection, Iterable, Optional

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


def command(bwrap: str, argv: list[str], hidden: Iterable[Path], visible: Iterable[Path],
            info_fd: int, masked: Iterable[Path] = (), account: Optional[Account] = None) -> list[str]:
    """``argv`` wrapped in bwrap: ``hidden`` folders covered, ``visible`` ones (inside them)
    mounted back, ``masked`` device files made unopenable; the sandbox's pid is written to
    ``info_fd`` as JSON ``{"child-pid": N}``, and it leads its own process group (signal that
    one, not bwrap's).

    With ``account`` (accounts.py) the command runs as that account, the folders on the way to
    the visible ones and to Python and this package that it cannot pass are covered too, and
    Python and this package are mounted back read-only (an interpreter under /root)."""
    out = [bwrap, "--die-with-parent", "--unshare-pid", "--new-session", "--info-fd", str(info_fd),
           "--dev-bind", "/", "/", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/dev/shm"]
    visible = sorted({Path(p).resolve() for p in visible if Path(p).exists()})
    covered: list[Path] = []
    binds: list[tuple[str, Path]] = []
    if account is not None:
        code = accounts.code_folders()
        covered += _outermost(accounts.out_of_reach(account, [*visible, *code]))
        binds += [("--ro-bind", path) for path in code]
    covered += _outermost(hidden)
    binds += [("--bind", path) for path in visible]
    for path in covered:
        out += ["--tmpfs", str(path)]
    for flag, path in binds:
        if account is not None:  # the folders bwrap makes on the way are 0700: let the account pass
            for folder in reversed(path.parents):
                if any(c == folder or c in folder.parents for c in covered):
                    out += ["--perms", "0755", "--dir", str(folder)]
        out += [flag, str(path), str(path)]
    for path in masked:
        out += ["--ro-bind", os.devnull, str(path)]
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
