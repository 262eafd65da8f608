"""Modes and settings that ``with`` statements switch and scripts also set by a plain call: autograd's
grad mode, the ``decimal`` context, and the process settings of process_settings.py that a with
statement switches (``np.printoptions``, ``np.errstate``, ``warnings.catch_warnings``,
``torch.autograd.detect_anomaly``, ``with torch.device("meta")``) and the working directory
(``contextlib.chdir``).

``torch.set_grad_enabled(False)`` at the top of an evaluation script, or
``decimal.getcontext().prec = 6``, runs once; a restore does not run it again and the new
process starts with grad mode on and 28 digits: tensors made after it required grad, sums came
out with other digits, a silent difference. Saving the value at the safe point is not enough
either: a restore enters the ``with`` statements around the safe point again
(``with torch.enable_grad():``), and each remembers the mode it found, to put back at its end.
So a checkpoint records each mode twice: before the outermost ``with`` statement around the safe
point (put back before the restore enters them: `apply_outer`) and at the safe point (put back once
it has: `apply_inner`, when the restore reaches its position). The settings are recorded before
a with statement only when one of its context managers switches them
(`process_settings.switches_settings`: ~30 us then), and at the safe point only when such a
statement is around it (the checkpoint's ``process`` has them too, applied first).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from . import context, process_settings

_pending: dict[str, Any] = {}


def current() -> tuple[Optional[bool], Any]:
    """(autograd's grad mode, the decimal context) of this thread; None for a library not loaded
    (never loads one). A with statement's frame keeps what they were before it (``modes_before``)."""
    torch = sys.modules.get("torch")
    decimal = sys.modules.get("decimal")
    return (torch.is_grad_enabled() if torch is not None else None,
            decimal.getcontext() if decimal is not None else None)


def capture(withs: Sequence[Any], chain: Sequence[Any] = ()) -> dict[str, tuple[Any, Any]]:
    """name -> (outer, inner) for the modes of the loaded libraries; ``withs``: the frames of the
    with statements around the safe point, outermost first; ``chain``: the program's frames down
    to it (`frames.UserFrame`), whose ``grad_before`` is the caller's grad mode where a
    ``@torch.no_grad()`` wrapper stands above one (grad_decorators.py): outside it, when it is
    outside every with statement. The decimal context is kept as the
    object itself: the one a ``localcontext()`` puts back at its end, which the program may have
    changed since, and the one a variable (``ctx = decimal.getcontext()``) may hold."""
    now = current()
    before = withs[0].modes_before if withs else now
    decorated = _decorated_grad(chain)
    if decorated is not None:
        before = (decorated, before[1])
    out: dict[str, tuple[Any, Any]] = {}
    for index, name in enumerate(("grad", "decimal")):
        if now[index] is not None:
            out[name] = (before[index] if before[index] is not None else now[index], now[index])
    switched = [frame.settings_before for frame in withs if frame.settings_before is not None]
    if switched:
        out["settings"] = (switched[0], settings_now())
    return out


def _decorated_grad(chain: Sequence[Any]) -> Optional[bool]:
    """The caller's grad mode of the outermost grad-mode decorator on the way to the safe point,
    when no with statement is outside it (else None: the with statements' rule holds)."""
    for user in chain:
        if user.grad_before is not None:  # the wrapper stands between the previous frame and this one
            return user.grad_before
        if any(getattr(entry, "kind", None) == "with" for entry in user.entries):
            return None
    return None


def settings_now() -> dict[str, Any]:
    """What a with frame records before a context manager that switches settings
    (`process_settings.switches_settings`): the process settings and the working directory
    (``contextlib.chdir``), as the job's folder sees it (a synced copy elsewhere resolves it)."""
    return {**process_settings.snapshot(), "cwd": context.relative_path(os.getcwd())}


def apply_outer(saved: Optional[dict]) -> None:
    """Before a restore enters the with statements again: the modes outside them."""
    _pending.clear()
    _set({name: outer for name, (outer, _inner) in (saved or {}).items()})
    _pending.update({name: inner for name, (_outer, inner) in (saved or {}).items()})


def apply_inner() -> None:
    """Once the restore has reached the safe point: the modes there."""
    _set(_pending)
    _pending.clear()


def _set(values: dict[str, Any]) -> None:
    if "settings" in values:
        process_settings.apply_switchable(values["settings"])
        cwd = context.resolve_path(*values["settings"]["cwd"])
        if os.getcwd() != cwd:
            os.chdir(cwd)
    if "grad" in values:
        import torch

        torch.set_grad_enabled(values["grad"])
    if "decimal" in values:
        import decimal

        decimal.setcontext(values["decimal"])
