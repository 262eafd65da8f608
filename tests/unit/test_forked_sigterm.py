"""A process a job forks ends on SIGTERM, as it would without the service, even when the signal
arrives while the child is being made: the worker's SIGTERM handler (a preemption notice) is
not inherited (`backend.worker.main.stop_on_sigterm`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FORK_AND_TERMINATE = """
import os, signal, sys, time
from backend.worker.main import stop_on_sigterm

class NoCheckpoints:  # the worker's controller: only the worker itself may ask it for a checkpoint
    def request_checkpoint(self, *args):
        raise AssertionError("a forked child asked the worker's controller for a checkpoint")

stop_on_sigterm(NoCheckpoints())
ended = []
for _ in range(FORKS):
    pid = os.fork()
    if pid == 0:
        time.sleep(2)
        os._exit(0)  # still alive two seconds later: the SIGTERM was lost
    os.kill(pid, signal.SIGTERM)  # at once: often before the child has run at all
    _, status = os.waitpid(pid, 0)
    ended.append(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
print(sum(ended), len(ended))
"""


def test_forked_children_end_on_sigterm_sent_while_they_start():
    forks = 40
    out = subprocess.run([sys.executable, "-c", FORK_AND_TERMINATE.replace("FORKS", str(forks))],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=forks * 3 + 60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(forks), str(forks)], out.stdout  # every child ended by the SIGTERM
