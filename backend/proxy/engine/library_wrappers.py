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

Command-line libraries are the other case: their frames stand between the top level and
``main``, and a restore calls the entry point again exactly as the call site did, so the library
parses the job's ``sys.argv`` (which the checkpoint carries) and calls ``main`` with the same
values, which the restore then replaces by the saved locals:

- a command object called with no arguments (`NodeInfo.bare`): a ``click`` command or group
  (``@click.command()`` with ``@click.option`` decorators on ``main``, called as ``main()``), a
  ``typer.Typer()`` app (``app()``); ``main(standalone_mode=False)`` would be called again without
  its arguments, so it does not count;
- a runner handed the program's function (`NodeInfo.runs`): ``fire.Fire(main)``,
  ``typer.run(main)``, with arguments a restore may evaluate again (`analysis.is_pure`).

``@hydra.main`` on ``main(cfg)``, called as ``main()``, is a wrapper of the first kind whose setup
must not run twice (it would make a new output folder named by the time of the restore): a
restore calls it with a config passed through (`placeholder`), and hydra_state.py carries what
the setup left.

The program's ``@torch.no_grad()`` (and the other grad-mode decorators) are grad_decorators.py's
wrappers, which record the caller's mode they put back on return; a restore sets it before it
calls them again.

Not listed, so still unusable below: other decorators that switch a mode and put back, on
return, the mode they found (``@torch.autocast``): a restore cannot know the caller's mode they
would put back, since no frame records it (a ``with`` statement of the program does,
`scoped_modes`); ``contextlib``'s decorators run the program's own ``__enter__`` again;
``fire.Fire()`` without a component reads its caller's names, which a restore's caller is not.
"""
from __future__ import annotations

import types
from typing import Any, Optional

from . import grad_decorators

#: (file suffix, qualified names) of the wrapper functions' code
_CLICK_CORE = ("Command.__call__", "BaseCommand.__call__", "Command.main", "BaseCommand.main", "Command.invoke",
               "Context.invoke", "Group.invoke", "MultiCommand.invoke")
_HYDRA_MAIN = ("hydra/main.py", "main.<locals>.main_decorator.<locals>.decorated_main")
_KNOWN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch/distributed/elastic/multiprocessing/errors/__init__.py", ("record.<locals>.wrap.<locals>.wrapper",)),
    ("click/decorators.py", ("pass_context.<locals>.new_func", "pass_obj.<locals>.new_func")),
    ("click/core.py", _CLICK_CORE),
    ("typer/_click/core.py", _CLICK_CORE),  # typer ≥ 0.16 carries its own copy of click
    ("typer/_click/decorators.py", ("pass_context.<locals>.new_func", "pass_obj.<locals>.new_func")),
    ("typer/core.py", ("TyperCommand.main", "TyperGroup.main", "_main", "TyperGroup.invoke")),
    ("typer/main.py", ("Typer.__call__", "run", "get_callback.<locals>.wrapper")),
    ("fire/core.py", ("Fire", "_Fire", "_CallAndUpdateTrace")),
    # @hydra.main: called again with a config passed through, it calls main at once (`placeholder`)
    (_HYDRA_MAIN[0], (_HYDRA_MAIN[1],)),
    ("hydra/_internal/utils.py", ("_run_hydra", "_run_app", "_run_app.<locals>.<lambda>", "run_and_report")),
    ("hydra/_internal/hydra.py", ("Hydra.run",)),
    ("hydra/core/utils.py", ("run_job",)),
)
#: callee expressions of the runners (`rewrite`); the object itself is checked (`_is_runner`)
RUNNER_CALLEES = frozenset({"fire.Fire", "Fire", "typer.run"})


def _path(code: types.CodeType) -> str:
    return code.co_filename.replace("\\", "/")


def is_wrapper_code(code: types.CodeType) -> bool:
    if grad_decorators.is_wrapper_code(code):
        return True
    name, path = code.co_qualname, _path(code)
    return any(name in names and path.endswith(suffix) for suffix, names in _KNOWN)


def _is_click_command(obj: Any) -> bool:
    return any(c.__name__ in ("Command", "BaseCommand") and c.__module__ in ("click.core", "typer._click.core")
               for c in type(obj).__mro__)


def _is_typer_app(obj: Any) -> bool:
    return any(c.__name__ == "Typer" and c.__module__ == "typer.main" for c in type(obj).__mro__)


def is_command(obj: Any) -> bool:
    """A click command or group, or a typer app: called again only as ``main()`` (`NodeInfo.bare`)."""
    return _is_click_command(obj) or _is_typer_app(obj)


def _is_runner(obj: Any) -> bool:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return (module, name) in (("fire.core", "Fire"), ("typer.main", "run"))


def _callbacks(obj: Any) -> list[Any]:
    """The program's functions a command may call: its callback and, for a group or an app, those
    of its subcommands (which one runs is the command line's choice)."""
    out: list[Any] = []
    if _is_typer_app(obj):
        infos = [*obj.registered_commands, obj.registered_callback]
        out += [info.callback for info in infos if info is not None and info.callback is not None]
        for group in obj.registered_groups:
            out += _callbacks(group.typer_instance)
        return out
    if getattr(obj, "callback", None) is not None:
        out.append(obj.callback)
    for sub in (getattr(obj, "commands", None) or {}).values():
        out += _callbacks(sub)
    return out


def entry_targets(fn: Any, args: tuple = ()) -> Optional[list[Any]]:
    """What a call of ``fn`` with ``args`` may run of the program when ``fn`` is a command-line
    entry point (a command, or a runner given the function first); None for any other callable."""
    if is_command(fn):
        return _callbacks(fn)
    if _is_runner(fn):
        return list(args[:1])
    return None


def placeholder(func: types.FunctionType) -> Any:
    """The value `Runtime.reenter` passes for each of the program function's parameters when it
    calls ``func`` (its arrival loads the saved ones instead). None, except for ``@hydra.main``'s
    wrapper: given a config (``cfg_passthrough``), it calls ``main`` at once instead of parsing
    the command line, making a new output folder and configuring logging again (what that setup
    left in the process is carried: hydra_state.py, process_settings.py, context.py)."""
    code = func.__code__
    if code.co_qualname == _HYDRA_MAIN[1] and _path(code).endswith(_HYDRA_MAIN[0]):
        return _REENTERED
    return None


_REENTERED = "re-entered by a restore"


def unwrap(func: Optional[types.FunctionType]) -> Optional[types.FunctionType]:
    """The function a transparent wrapper calls (through several), else ``func`` itself."""
    while func is not None and is_wrapper_code(func.__code__):
        inner = getattr(func, "__wrapped__", None)
        if not isinstance(inner, types.FunctionType):
            return func
        func = inner
    return func
