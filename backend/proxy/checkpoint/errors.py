"""Exceptions the device proxy raises.

`Preempted` derives from BaseException so that a user's ``except Exception:`` cannot swallow a
preemption; the rewritten code also makes sure bare ``except:`` handlers re-raise it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol


class Committed(Protocol):
    """What a stop reports of the checkpoint it stopped at (a ``store.CheckpointRef``)."""

    path: Path
    step: int


class CheckpointError(Exception):
    """A checkpoint cannot be written or restored; the message says what to do."""


class CheckpointFailure(CheckpointError):
    """A checkpoint attempt failed at a safe point; the program keeps running.

    ``variables`` names what could not be saved as ``[[name, type], ...]``.
    """

    def __init__(self, message: str, variables: Optional[list[list[str]]] = None) -> None:
        super().__init__(message)
        self.variables: list[list[str]] = variables or []


class Preempted(BaseException):
    """Raised out of `ResumableProgram.run` once a ``then='stop'`` checkpoint has been written."""

    def __init__(self, checkpoint: Committed) -> None:
        super().__init__(f"preempted after checkpoint {checkpoint.path} (step {checkpoint.step})")
        self.checkpoint = checkpoint
