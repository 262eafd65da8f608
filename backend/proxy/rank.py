"""One rank of a program under the engine: the steps every entry point takes, in one place.

The service's worker (``backend/worker/main.py``), the local CLI (``python -m backend.proxy``)
and the ranks of the local launcher (``python -m backend.proxy.launch --checkpoint-dir``) all
run a rank through `run_rank`: a controller (one that agrees checkpoints with the other ranks
when there are several), the newest checkpoint when asked to resume (refused when it has
another number of ranks; the process group made first, so the program's DDP modules attach to
it as they load), then the program. What differs between them (where events go, how a
request arrives, what a result becomes) is theirs: `run_rank` raises what the program raised,
`Preempted` included.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .checkpoint.errors import CheckpointError
from .checkpoint.store import CheckpointRef, CheckpointStore
from .engine.controller import Controller
from .engine.program import ResumableProgram

OnEvent = Callable[[str, dict], None]


class RankCountMismatch(CheckpointError):
    """The checkpoint to resume was written by another number of ranks than this job has."""


@dataclass
class RankRun:
    """What a run of one rank needs; `run_rank` fills in ``controller`` and ``restored``."""

    store: CheckpointStore
    rank: int = 0
    world_size: int = 1
    restore: bool = False
    checkpoint_every: Optional[float] = None
    on_event: OnEvent = field(default=lambda type_, data: None)
    controller: Optional[Controller] = None
    #: the checkpoint this run resumes (None: it starts from the beginning)
    restored: Optional[CheckpointRef] = None


def main_namespace(filename: str) -> dict[str, Any]:
    """A fresh ``__main__`` module for the program (``sys.modules['__main__']``: pickles of its
    classes and functions name it), and its namespace."""
    module = types.ModuleType("__main__")
    module.__file__ = filename
    namespace = module.__dict__
    namespace["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    return namespace


def make_controller(run: RankRun) -> Controller:
    """One rank's controller: checkpoints agreed by every rank when there are several."""
    if run.world_size > 1:
        from .distributed.cut import DistributedController

        return DistributedController(run.store, run.rank, run.world_size, checkpoint_every=run.checkpoint_every,
                                     on_event=run.on_event)
    return Controller(run.store, rank=run.rank, world_size=run.world_size, checkpoint_every=run.checkpoint_every,
                      on_event=run.on_event)


def resume_point(run: RankRun) -> Optional[CheckpointRef]:
    """The checkpoint to resume, if asked and there is one; `CheckpointError` when it has another
    number of ranks (a job keeps its number of ranks for life; a resize changes their placement)."""
    if not run.restore:
        return None
    ref = run.store.latest()
    if ref is not None and ref.world_size != run.world_size:
        raise RankCountMismatch(f"checkpoint {ref.path} has {ref.world_size} ranks, this job has {run.world_size}; "
                              f"a job keeps its number of ranks for life")
    if ref is not None and run.world_size > 1:
        from .distributed.collectives import restore_process_group

        restore_process_group()  # the namespace's DDP modules attach to it as they load
    return ref


def run_rank(program: ResumableProgram, namespace: dict[str, Any], run: RankRun,
             before: Optional[Callable[[RankRun], None]] = None) -> Any:
    """Run ``program`` as this rank: the controller and the checkpoint to resume are set on
    ``run`` and ``before(run)`` is called (an entry point's own hooks: how requests arrive,
    inputs of a fresh start), then the program; returns its result."""
    run.controller = make_controller(run)
    run.restored = resume_point(run)
    if before is not None:
        before(run)
    return program.run(namespace, run.controller, restore=run.restored)
