"""``@torch.no_grad()`` on a function of the program with a loop in it (``def evaluate(...)``).

torch's wrapper enters the mode, calls the function and, on return, puts back the mode it found:
the caller's, which it keeps only on the interpreter's stack, where no checkpoint can read it. A
restore re-enters the function through the wrapper, which then finds whatever mode the restore
had set, and so put back a wrong one at the end of ``evaluate()``: the training after it ran
without gradients. So checkpoints waited until such a function returned.

The program's grad-mode decorators (``torch.no_grad``, ``enable_grad``, ``set_grad_enabled(m)``,
``inference_mode``), made once the program runs, are this module's wrapper instead of torch's
(`install`): the same ``with`` around the same call, with the caller's grad mode in a local
(`caller_grad_mode`) too. A checkpoint reads it from the frame (`frames.user_chain`) as the grad
mode outside the wrapper (`scoped_modes`), a restore puts it back before it calls the wrapper
again (`library_wrappers`), and the wrapper then finds what it found the first time.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable, Optional

from . import lazy

#: the managers whose decorators are made by `_decorate` (torch.autograd.grad_mode's classes)
_GRAD_MANAGERS = frozenset({"no_grad", "enable_grad", "set_grad_enabled", "inference_mode"})
#: the local of `_decorate`'s wrapper that holds the caller's grad mode
CALLER_MODE = "caller_grad_mode"
_torch_context_decorator: Optional[Callable[..., Any]] = None


def install() -> None:
    """From now on, torch's grad-mode decorators are `_decorate`'s (before torch is imported: once it is)."""
    lazy.when_imported("torch.utils._contextlib", _patch)


def _patch(module: types.ModuleType) -> None:
    global _torch_context_decorator
    if _torch_context_decorator is None:
        _torch_context_decorator = module.context_decorator
        module.context_decorator = _context_decorator


def _is_grad_manager(ctx: Any) -> bool:
    manager = getattr(ctx, "__self__", None)  # torch passes the manager's bound ``clone``
    t = type(manager)
    return t.__module__ == "torch.autograd.grad_mode" and t.__name__ in _GRAD_MANAGERS


def _context_decorator(ctx: Any, func: Any) -> Any:
    """torch's ``context_decorator``, but `_decorate` for a grad-mode manager over a plain function."""
    assert _torch_context_decorator is not None
    if not _is_grad_manager(ctx) or not isinstance(func, types.FunctionType) or inspect.isgeneratorfunction(func):
        return _torch_context_decorator(ctx, func)
    return _decorate(ctx, func)


def _decorate(ctx_factory: Callable[[], Any], func: types.FunctionType) -> Any:
    is_grad_enabled = sys.modules["torch._C"].is_grad_enabled  # loaded first by torch's own import

    @functools.wraps(func)
    def decorate_context(*args: Any, **kwargs: Any) -> Any:
        caller_grad_mode = is_grad_enabled()  # noqa: F841 (read by a checkpoint: `caller_mode`)
        with ctx_factory():
            return func(*args, **kwargs)

    return decorate_context


_FILE = "proxy/engine/grad_decorators.py"
_WRAPPER: types.CodeType = next(c for c in _decorate.__code__.co_consts if isinstance(c, types.CodeType))


def is_wrapper_code(code: types.CodeType) -> bool:
    """Whether ``code`` is `_decorate`'s wrapper: by name, since the wrapper of a method of the
    program's class comes back from a checkpoint as a copy, with a code object of its own."""
    return code.co_qualname == _WRAPPER.co_qualname and code.co_filename.replace("\\", "/").endswith(_FILE)


def caller_mode(frame: types.FrameType) -> Optional[bool]:
    """The grad mode the caller of a `_decorate` wrapper frame had (None for any other frame)."""
    return frame.f_locals.get(CALLER_MODE) if is_wrapper_code(frame.f_code) else None
