"""The device proxy: resumable execution of submitted Python code (DESIGN.md section 5).

Submitted code is compiled through an AST rewrite that turns every loop of the code's own
top level (or of a submitted function's body) into a resumable loop whose iterations are safe
points.  At a safe point a `Controller` can write a checkpoint (position, namespace, RNG states,
loop iterators) into a `CheckpointStore`; a new process resumes it bit for bit.
"""
from .engine.controller import Controller
from .checkpoint.errors import CheckpointError, CheckpointFailure, Preempted
from .engine.program import SOURCE_ATTR, ResumableProgram
from .checkpoint.store import CheckpointRef, CheckpointStore

__all__ = [
    "CheckpointError",
    "CheckpointFailure",
    "CheckpointRef",
    "CheckpointStore",
    "Controller",
    "Preempted",
    "ResumableProgram",
    "SOURCE_ATTR",
]
