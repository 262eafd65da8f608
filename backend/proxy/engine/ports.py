"""What the engine's parts see of each other: the program, its controller, and the runtime.

The runtime runs the program and asks the controller at its safe points; the checkpoint writer
reads all three; the controller reads where the runtime is. Each of them is typed here against
what it uses of the others, not against their classes, so the modules depend on this leaf and
never on each other in a circle (`ResumableProgram`, `Controller` and `Runtime` satisfy these).
"""
from __future__ import annotations

import types
from typing import Any, Callable, Optional, Protocol

from .checkpoint_request import CheckpointRequest


class ProgramView(Protocol):
    """A rewritten program: its statement tables and where its functions are."""

    filename: str
    identity: str
    patched_attributes: tuple  # library_patches.candidates
    patch_imports: dict  # library_patches.imported_names
    submodule_imports: tuple  # imported_submodules.candidates

    @property
    def code(self) -> Optional[types.CodeType]: ...

    @property
    def nodes(self) -> dict: ...

    @property
    def statements(self) -> list: ...

    @property
    def unstable(self) -> frozenset: ...

    @property
    def local_names(self) -> tuple: ...

    @property
    def defs(self) -> dict: ...

    @property
    def call_spans(self) -> dict: ...

    @property
    def has_safe_points(self) -> bool: ...

    def fid_of(self, code: types.CodeType) -> Optional[int]: ...


class ControllerView(Protocol):
    """The controller as the runtime and the checkpoint writer use it."""

    flag: bool
    rank: int
    world_size: int
    store: Any  # a CheckpointStore
    writer: Any  # a background.Writer
    write_behind: bool
    last_restore: Optional[dict[str, Any]]
    tracer: Optional[Callable[[int, dict], None]]

    def poll(self, rt: "RuntimeView") -> tuple[Optional[CheckpointRequest], bool]: ...

    def poll_progress(self) -> bool: ...

    def unusable(self, why: str) -> None: ...

    def all_written(self, mine: bool) -> bool: ...

    def checkpoint_written(self) -> None: ...

    def emit(self, type_: str, data: dict[str, Any]) -> None: ...


class RuntimeView(Protocol):
    """A running program's runtime, as the controller and the checkpoint writer read it."""

    program: ProgramView
    ctl: ControllerView
    ns: dict
    step: int
    stack: list
    chain: Optional[list]
    fn_frame: Any
    fn_globals: Optional[dict]
    unpicklable_cache: dict[str, int]
    preempting: bool
    preempted_exc: Optional[BaseException]
