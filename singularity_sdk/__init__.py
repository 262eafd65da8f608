"""Singularity for notebooks: preemptible, migratable, resizable deep-learning jobs.

    from singularity_sdk import LocalCluster
    with LocalCluster(nodes=2, devices_per_node=2) as cluster:
        job = cluster.client().submit("print('hi'); 6 * 7", gpus=1)
        job.result()   # 42

Inside a job, ``singularity_sdk.log(loss=..., step=...)`` adds a point to its training curve
(``job.metrics()``, the notebook widget's chart); outside a job it does nothing.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it. Imported on first use: a job's worker imports
#: parts of this package (the folder format, ``log``) and must not pay for the HTTP client.
_HOMES = {
    "AsyncClient": "aio", "AsyncJob": "aio", "Client": "client", "Job": "client", "LocalCluster": "local",
    "log": "report", "SLA": "protocol", "Event": "protocol", "EventType": "protocol", "JobInfo": "protocol",
    "JobState": "protocol", "NodeInfo": "protocol",
    **{name: "errors" for name in ("APIError", "AuthError", "CheckpointFailed", "ConfigError", "Conflict",
                                   "InvalidRequest", "JobCancelled", "JobFailed", "JobNotFound",
                                   "ServerUnreachable", "SingularityError", "WaitTimeout")},
}

if TYPE_CHECKING:
    from .aio import AsyncClient, AsyncJob
    from .client import Client, Job
    from .errors import (APIError, AuthError, CheckpointFailed, ConfigError, Conflict, InvalidRequest, JobCancelled,
                         JobFailed, JobNotFound, ServerUnreachable, SingularityError, WaitTimeout)
    from .local import LocalCluster
    from .protocol import SLA, Event, EventType, JobInfo, JobState, NodeInfo
    from .report import log


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'singularity_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "APIError", "AsyncClient", "AsyncJob", "AuthError", "CheckpointFailed", "Client", "ConfigError", "Conflict", "Event", "EventType",
    "InvalidRequest", "Job", "JobCancelled", "JobFailed", "JobInfo", "JobNotFound", "JobState", "LocalCluster",
    "NodeInfo", "SLA", "log", "ServerUnreachable", "SingularityError", "WaitTimeout",
]
__version__ = "0.1.0"
