"""Exceptions the SDK raises. Each message says what happened and what to do about it."""
from __future__ import annotations

from typing import Optional


class SingularityError(Exception):
    """Base of every SDK error."""


class ConfigError(SingularityError):
    """No server could be found from arguments, environment or server.json."""


class ServerUnreachable(SingularityError):
    pass


class APIError(SingularityError):
    """The server answered with an error; ``status`` and ``field`` say which and where."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


class AuthError(APIError):
    pass


class JobNotFound(APIError):
    pass


class InvalidRequest(APIError):
    pass


class Conflict(APIError):
    pass


class JobFailed(SingularityError):
    """``job.result()`` of a job whose code raised; the message is the remote traceback."""

    def __init__(self, job_id: str, traceback: str):
        super().__init__(f"job {job_id} failed:\n{traceback}")
        self.job_id = job_id
        self.traceback = traceback


class JobCancelled(SingularityError):
    pass


class WaitTimeout(SingularityError, TimeoutError):
    pass


class CheckpointFailed(SingularityError):
    """A checkpoint (or the preemption that needed it) could not be taken; the job runs on.

    ``variables`` lists ``[name, type]`` of what could not be captured."""

    def __init__(self, job_id: str, error: str, variables: Optional[list] = None):
        super().__init__(f"job {job_id}: checkpoint failed, the job keeps running: {error}")
        self.job_id = job_id
        self.error = error
        self.variables = variables or []
