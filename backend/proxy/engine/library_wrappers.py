"""Library decorators a restore may call again on its way back into the program's function.

A safe point is usable only if every frame from the top level down to it is the program's
(`frames.user_chain`): a restore re-enters each call. A library frame in between makes every safe
point below it unusable, and ``@record`` on ``main()`` (torch.distributed.elastic's error recorder,
which torchrun scripts put on their entry point) put one above all of them: such a job could
never be checkpointed.

A wrapper listed here is transparent: it sets up what depends on nothing of the program's state
(an error handler) and calls the wrapped function with the arguments it was given. So a restore
calls the wrapper again, with the placeholder arguments `Runtime.reenter` passes, and arrives in
the program's function.

A ``click`` command (``@click.command()`` with ``@click.option`` decorators on ``main``, called as
``main()``) is the other case: click's frames stand between the call and ``main``, and a restore
calls the command again exactly as the call site did (no arguments: click parses the job's
``sys.argv``, which the checkpoint carries, and calls ``main`` with the same values, which the
restore then replaces by the saved locals). Only a call without arguments counts
(`NodeInfo.bare`): ``main(standalone_mode=False)`` would be called again without them.

Not listed, so still unusable below: decorators that switch a mode and put back, on return, the
mode they found (``@torch.no_grad()``, ``@torch.autocast``): a restore cannot know the mode of
the caller they would put back, since no frame of the program records it (a ``with`` statement
of the program does, `scoped_modes`); ``contextlib``'s decorators run the program's own
``__enter__`` again; ``hydra.main`` parses the command line and makes a new output folder.
"""
from __future__ import annotations

import types
from typing import Any, Optional

#: (file suffix, qualified name) of the wrapper functions' code
_KNOWN = (
    ("torch/distributed/elastic/multiprocessing/errors/__init__.py", "record.<locals>.wrap.<locals>.wrapper"),
    ("click/decorators.py", "pass_context.<locals>.new_func"),
    ("click/decorators.py", "pass_obj.<locals>.new_func"),
)
#: the frames of a click command's call, down to its callback (`is_wrapper_code`)
_CLICK_CALL = ("Command.__call__", "BaseCommand.__call__", "Command.main", "BaseCommand.main", "Command.invoke",
               "Context.invoke")


def _path(code: types.CodeType) -> str:
    return code.co_filename.replace("\\", "/")


def is_wrapper_code(code: types.CodeType) -> bool:
    name = code.co_qualname
    if name in _CLICK_CALL and _path(code).endswith("click/core.py"):
        return True
    return any(name == qualname and _path(code).endswith(suffix) for suffix, qualname in _KNOWN)


def is_click_command(obj: Any) -> bool:
    return any(c.__name__ in ("Command", "BaseCommand") and c.__module__ == "click.core" for c in type(obj).__mro__)


def target(fn: Any) -> Any:
    """What calling ``fn`` runs of the program: a click command's callback, else ``fn``."""
    return fn.callback if is_click_command(fn) else fn


def unwrap(func: Optional[types.FunctionType]) -> Optional[types.FunctionType]:
    """The function a transparent wrapper calls (through several), else ``func`` itself."""
    while func is not None and is_wrapper_code(func.__code__):
        inner = getattr(func, "__wrapped__", None)
        if not isinstance(inner, types.FunctionType):
            return func
        func = inner
    return func
