"""A pre-warmed launcher for CLI runs in tests.

Importing torch costs ~1.4 s per interpreter; the tests start dozens of runs.  This process
imports the heavy modules once and, per request, forks a child that runs
``python -m backend.proxy`` 's `main()` with its own argv, environment, cwd, stdout and stderr
files, then exits.  Every run is still a separate process: a checkpoint is always restored by a
different process than the one that wrote it.  The server never runs user code itself.

Protocol (JSON lines on stdin/stdout): request ``{"argv", "env", "cwd", "stdout", "stderr"}``,
answers ``{"pid": N}`` at once and ``{"rc": N}`` when the child exits.
"""
import json
import os
import sys
import traceback

import cloudpickle  # noqa: F401  (warm imports the runs need)
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.utils.data  # noqa: F401

from backend.proxy.__main__ import main


def _child(req: dict) -> None:
    rc = 1
    try:
        os.chdir(req["cwd"])
        os.environ.update(req["env"])
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        sys.stdin = open(os.devnull)
        rc = main(req["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc)


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    serve()
