"""Singularity for notebooks: preemptible, migratable, resizable deep-learning jobs.

    from singularity_sdk import LocalCluster
    with LocalCluster(nodes=2, devices_per_node=2) as cluster:
        job = cluster.client().submit("print('hi'); 6 * 7", gpus=1)
        job.result()   # 42

Inside a job, ``singularity_sdk.log(loss=..., step=...)`` adds a point to its training curve
(``job.metrics()``, the notebook widget's chart); outside a job it does nothing.
"""
from .aio import AsyncClient, AsyncJob
from .client import Client, Job
from .errors import (
    APIError,
    AuthError,
    CheckpointFailed,
    ConfigError,
    Conflict,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    JobNotFound,
    ServerUnreachable,
    SingularityError,
    WaitTimeout,
)
from .local import LocalCluster
from .protocol import SLA, Event, EventType, JobInfo, JobState, NodeInfo
from .report import log

__all__ = [
    "APIError", "AsyncClient", "AsyncJob", "AuthError", "CheckpointFailed", "Client", "ConfigError", "Conflict", "Event", "EventType",
    "InvalidRequest", "Job", "JobCancelled", "JobFailed", "JobInfo", "JobNotFound", "JobState", "LocalCluster",
    "NodeInfo", "SLA", "log", "ServerUnreachable", "SingularityError", "WaitTimeout",
]
__version__ = "0.1.0"
