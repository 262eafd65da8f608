"""A sandboxed job opens only its own GPUs' device files: the others are masked (bwrap binds
/dev/null over them without device access). No GPU here: the choice of files is tested on a
folder of stand-ins, the masking itself on a real device file that every machine has."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.agent import sandbox


def test_every_gpu_file_but_the_jobs_own_is_masked(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia10", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "null"):
        (tmp_path / name).touch()
    assert sandbox.gpu_files_to_mask({1}, tmp_path) == [tmp_path / n for n in ("nvidia0", "nvidia10", "nvidia2")]
    assert sandbox.gpu_files_to_mask(set(), tmp_path) == [tmp_path / n for n in ("nvidia0", "nvidia1", "nvidia10",
                                                                                 "nvidia2")]
    # minor numbers unknown (no NVML): nothing is masked rather than, blindly, the job's own GPU
    assert sandbox.gpu_files_to_mask(None, tmp_path) == []
    assert sandbox.gpu_files_to_mask({0}, tmp_path / "missing") == []


@pytest.mark.skipif(sandbox.choose() is None, reason="no working bwrap here (make setup installs bubblewrap)")
def test_a_masked_device_file_cannot_be_opened_in_the_sandbox():
    probe = ("import sys\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n"
             "        open(path, 'rb').read(1); print(path, 'open')\n"
             "    except OSError as e:\n"
             "        print(path, type(e).__name__)\n")
    argv = [sys.executable, "-c", probe, "/dev/zero", "/dev/urandom"]
    r, w = os.pipe()
    try:
        cmd = sandbox.command(sandbox.choose(), argv, sandbox.plan([], [], masked=[Path("/dev/zero")]), w)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, pass_fds=(w,))
    finally:
        os.close(r)
        os.close(w)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["/dev/zero PermissionError", "/dev/urandom open"]
