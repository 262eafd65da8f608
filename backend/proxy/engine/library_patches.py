"""Attributes the program sets on library modules and classes: monkeypatches.

``F.gelu = my_gelu`` or ``LlamaAttention.forward = flash_forward`` near the top of a script
changes a library, not a variable. A restore does not run that statement again, and the new
process imports the library as shipped: the model computed something else from the safe point
on, silently. So the statements of the program that assign to an attribute of a dotted name
(``torch.nn.Linear.forward = ...``; not ``self.x``/``cls.x``) are listed when it is rewritten
(`candidates`), and each checkpoint records, for those whose name leads through modules and
classes only, the attribute's current value (`capture`); a restore sets them again before
the program continues (`apply`). A statement not yet run records the library's own value, which
setting again changes nothing. Attributes of ``sys`` are process_settings.py's.
"""
from __future__ import annotations

import ast
import sys
import types
import warnings
from typing import Any, Callable, Optional

Candidate = tuple[tuple[str, ...], str]  # (the dotted name's parts, the attribute)
_warned: set[tuple[int, str]] = set()


def _dotted(node: ast.expr) -> Optional[tuple[str, ...]]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return tuple(reversed(parts))


def candidates(tree: ast.AST) -> tuple[Candidate, ...]:
    """``(name parts, attribute)`` of every assignment to ``a.b.attr`` in ``tree`` (any depth)."""
    found: set[Candidate] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute):
                owner = _dotted(target.value)
                if owner and owner[0] not in ("self", "cls") and not owner[0].startswith("__sg"):
                    found.add((owner, target.attr))
    return tuple(sorted(found))


def _owner(program_globals: dict, parts: tuple[str, ...]) -> Any:
    """The module or class ``parts`` names in the program's globals, else None (a local variable,
    an instance: its attributes are saved with it)."""
    obj = program_globals.get(parts[0])
    for part in parts[1:]:
        if not isinstance(obj, (types.ModuleType, type)):
            return None
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - a lazy module attribute that fails: nothing to keep
            return None
    return obj if isinstance(obj, (types.ModuleType, type)) and obj is not sys else None


def capture(program_globals: dict, found: tuple[Candidate, ...],
            probe: Callable[[Any], Optional[str]]) -> list[tuple[Any, str, Any]]:
    """``[(module or class, attribute, value)]`` to set again on restore."""
    out = []
    for parts, attr in found:
        owner = _owner(program_globals, parts)
        if owner is None:
            continue
        try:
            value = getattr(owner, attr)
        except AttributeError:
            continue
        why = probe(value)
        if why is not None:
            if (id(owner), attr) not in _warned:
                _warned.add((id(owner), attr))
                warnings.warn(f"{'.'.join(parts)}.{attr} cannot be saved ({why}); after a restore it has "
                              f"the value a fresh import gives it", RuntimeWarning, stacklevel=3)
            continue
        out.append((owner, attr, value))
    return out


def apply(saved: Optional[list]) -> None:
    for owner, attr, value in saved or ():
        try:
            if getattr(owner, attr, None) is not value:
                setattr(owner, attr, value)
        except (AttributeError, TypeError) as exc:
            warnings.warn(f"{getattr(owner, '__name__', owner)}.{attr} could not be set again ({exc}); "
                          f"results after the restore may differ", RuntimeWarning, stacklevel=2)
