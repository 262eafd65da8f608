"""``singularity_sdk.log(loss=..., step=...)``: numbers a job reports for its training curve.

Inside a job the values go to the node agent on the worker's control pipe (the same one the
checkpoint engine reports on) and become a ``telemetry`` event the widget, ``job.metrics()`` and
anything following the job see. Outside a job (no control pipe) it does nothing, so the same
script runs unchanged on a laptop. It never raises into the training loop.
"""
from __future__ import annotations

import json
import math
import os
import stat
from typing import Optional, Union

#: the descriptor of a job's channel to its worker, where `log` writes (set by the agent)
CONTROL_FD_ENV = "SINGULARITY_CONTROL_FD"

Number = Union[int, float]
#: One write of at most this many bytes to a pipe is atomic (POSIX PIPE_BUF), so a report never
#: interleaves with the worker's own messages on the same pipe.
MAX_LINE = 4000


def log(step: Optional[Number] = None, **values: Number) -> bool:
    """Report ``values`` (``loss=0.3, acc=0.9``) at ``step``; returns whether they were sent.

    Without ``step`` a point's x is its index in the series. Non-numbers and infinities are
    skipped. A no-op outside a Singularity job."""
    fd = os.environ.get(CONTROL_FD_ENV)
    if not fd:
        return False
    metrics = {str(k): float(v) for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if not metrics:
        return False
    data: dict = {"metrics": metrics}
    if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
        data["step"] = step
    line = (json.dumps({"type": "telemetry", "data": data}) + "\n").encode()
    if len(line) > MAX_LINE:
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return False  # a child process that inherited the variable but not the pipe
        os.write(int(fd), line)
    except (OSError, ValueError):
        return False
    return True
