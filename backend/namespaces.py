"""A fork of the warm spawner enters its job's sandbox itself: the namespaces bwrap would make.

A sandboxed worker used to start as a fresh interpreter under bwrap, because a fork of the
spawner shares the spawner's namespaces; a restore then waited 1-2 s for ``import torch``. Here
the forked child makes the same sandbox on its own before it runs any of the job's code, from
the same list of mounts `backend.agent.sandbox.plan` gives bwrap:

1. the child (the *keeper*, still in the host's PID namespace) unshares a mount namespace, a
   PID namespace and, when not root, a user namespace that maps its own uid and gid only, and
   opens every folder it will mount back while it can still see it;
2. it covers the hidden folders with empty tmpfs mounts, gives the job its own ``/dev/shm``,
   binds the job's folders back (from the descriptors opened in 1), and masks the other GPUs'
   device files with a read-only, ``nodev`` ``/dev/null``;
3. it forks the sandbox's pid 1 (the *init*), which mounts a ``/proc`` of the new PID namespace
   (its ``sys``, ``sysrq-trigger``, ``irq`` and ``bus`` read-only, as bwrap does), switches to
   the job's OS account if there is one (``serve --run-as``), drops every capability for good
   (bounding set, ambient set, then the sets themselves, with ``no_new_privs``), and forks the
   worker, pid 2;
4. the worker returns from `enter` and goes on as the fork server's child always did.

The keeper and the init hold no descriptor of the job's and run nothing of it: the keeper waits
for the init and leaves with its exit code; the init reaps, and leaves with the worker's code
(``128 + N`` for a signal, as bwrap reports it). Both ignore the job's signals (a stop is sent
to the session, which the worker also leads), both die with their parent, and the kernel ends
every process of the sandbox when its init ends.

This module imports nothing of the project: the fork server loads it beside its targets.
``python -m backend.namespaces`` tries the whole sequence once and exits 0 where it works.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
from typing import Any, Optional

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT = 32
MS_NOATIME, MS_NODIRATIME = 1024, 2048
MS_BIND, MS_REC = 4096, 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAPABILITY_V3 = 0x20080522
#: what ``/proc`` keeps read-only inside (as bwrap does)
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus")
#: the mount kinds of a plan (backend/agent/sandbox.py `Mount`)
KINDS = ("tmpfs", "dir", "bind", "ro-bind", "mask")


class SandboxError(OSError):
    """A step of the sandbox failed; the message names the step and the path."""


def enter(mounts: list[dict[str, Any]], account: Optional[dict[str, Any]] = None) -> None:
    """Make this (forked, single-threaded) process's sandbox; returns only in the worker.

    ``mounts``: ``{"kind", "path"[, "mode"]}`` in order (kinds in `KINDS`); ``account``:
    ``{"uid", "gid", "groups"}`` to run as (root only). Raises `SandboxError` if a step fails:
    in the keeper for the mounts, in the sandbox's pid 1 for ``/proc`` and the privileges."""
    libc = _libc()
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper dies with the spawner
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | (0 if uid == 0 else CLONE_NEWUSER)), "unshare", "")
    if uid != 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    # opened in the new mount namespace (a bind's source must be in it), before any cover
    saved_umask = os.umask(0o022)
    sources = {m["path"]: os.open(m["path"], os.O_PATH | os.O_CLOEXEC)
               for m in mounts if m["kind"] in ("bind", "ro-bind")}
    null = os.open(os.devnull, os.O_PATH | os.O_CLOEXEC)
    try:
        for m in mounts:
            _apply(libc, m, sources.get(m["path"]), null)
    finally:
        for fd in (*sources.values(), null):
            os.close(fd)
        os.umask(saved_umask)
    init = os.fork()
    if init:
        _leave_with(init)
    # the sandbox's pid 1
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # (its parent is outside: getppid() says 0)
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        path = f"/proc/{name}"
        if os.path.exists(path):
            _mount(libc, path, path, None, MS_BIND | MS_REC)
            _remount_read_only(libc, path)
    _drop_privileges(libc, account)
    worker = os.fork()
    if worker:
        _leave_with(worker, reap_all=True)


def _apply(libc: ctypes.CDLL, m: dict[str, Any], source: Optional[int], null: int) -> None:
    kind, path, mode = m["kind"], m["path"], m.get("mode")
    if kind == "tmpfs":
        os.makedirs(path, exist_ok=True)  # missing only inside an earlier cover
        _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={0o755 if mode is None else mode:o}")
    elif kind == "dir":
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o755 if mode is None else mode)
    elif kind in ("bind", "ro-bind"):
        assert source is not None
        if os.path.isdir(f"/proc/self/fd/{source}"):
            os.makedirs(path, exist_ok=True)
        elif not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount(libc, f"/proc/self/fd/{source}", path, None, MS_BIND | MS_REC)
        if kind == "ro-bind":
            _remount_read_only(libc, path)
    elif kind == "mask":
        _mount(libc, f"/proc/self/fd/{null}", path, None, MS_BIND)
        _remount_read_only(libc, path, MS_NODEV)
    else:
        raise SandboxError(f"unknown mount kind {kind!r} for {path} (one of {', '.join(KINDS)})")


def _remount_read_only(libc: ctypes.CDLL, path: str, extra: int = 0) -> None:
    """Make a bind mount read-only, keeping the flags it had (a user namespace may not drop
    flags its mount was locked with)."""
    _mount(libc, None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | extra | _flags_of(path))


def _flags_of(path: str) -> int:
    """The mount flags of the mount ``path`` is on (statvfs's, in mount(2)'s numbering)."""
    f = os.statvfs(path).f_flag
    kept = f & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return kept | (MS_RELATIME if f & os.ST_RELATIME else 0)


def _drop_privileges(libc: ctypes.CDLL, account: Optional[dict[str, Any]]) -> None:
    """No capability now or after any exec, and the job's account if it has one."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _prctl(libc, PR_CAPBSET_DROP, cap)
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if account is not None:
        os.setgroups(list(account["groups"]))
        os.setgid(account["gid"])
        os.setuid(account["uid"])
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_V3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (two words each): none
    _check(libc.capset(header, data), "capset", "")
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)


def _leave_with(child: int, reap_all: bool = False) -> None:
    """Wait for ``child`` (reaping any other, as a pid 1 must) and exit with its code, holding
    nothing of the job's meanwhile; never returns."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    os.close(quiet)
    os.closerange(3, 256)
    while True:
        try:
            pid, status = os.waitpid(-1 if reap_all else child, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, step: str, path: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SandboxError(err, f"sandbox: {step} {path}: {os.strerror(err)}".rstrip())


def _mount(libc: ctypes.CDLL, source: Optional[str], target: str, fstype: Optional[str], flags: int,
           data: Optional[str] = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount", target)


def _prctl(libc: ctypes.CDLL, option: int, arg: int) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})", "")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def probe() -> Optional[str]:
    """None when a child can make a sandbox here, with every kind of mount a job's sandbox uses
    (a fork of this process tries: a covered folder with one inside bound back, a masked device
    file, its own /dev/shm and /proc), else why not."""
    with tempfile.TemporaryDirectory() as tmp:
        inside = os.path.join(tmp, "visible")
        os.mkdir(inside)
        open(os.path.join(tmp, "hidden"), "w").close()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                enter([{"kind": "tmpfs", "path": "/dev/shm", "mode": 0o1777}, {"kind": "tmpfs", "path": tmp},
                       {"kind": "bind", "path": inside}, {"kind": "mask", "path": "/dev/zero"}])
                seen = sorted(os.listdir(tmp))
                if os.getpid() != 2 or seen != ["visible"] or _opens("/dev/zero"):
                    raise SandboxError(f"the sandbox leaks: pid {os.getpid()}, {tmp} holds {seen}, "
                                       f"/dev/zero opens: {_opens('/dev/zero')}")
            except BaseException as exc:
                os.write(w, str(exc).encode()[:4000])
                os._exit(3)
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            why = f.read().decode(errors="replace")
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return None if code == 0 else why or f"the sandbox's worker ended with {code}"


def _opens(path: str) -> bool:
    try:
        open(path, "rb").close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    reason = probe()
    if reason:
        print(reason, file=sys.stderr)
    sys.exit(0 if reason is None else 1)
