"""Submodules the program imported with ``import a.b``: imported again on restore.

``import logging.config`` binds ``logging`` and, as a side effect of the import, sets the
attribute ``logging.config``. A checkpoint saves the module ``logging`` by name; the restoring
process imports ``logging`` alone, and the program's next ``logging.config.dictConfig(...)`` fails
with "module 'logging' has no attribute 'config'". So the program's ``import a.b`` statements
are listed when it is rewritten (`candidates`), each checkpoint records those that were imported
(`capture`), and a restore imports them before the program continues (`apply`). Helper modules of
the job run their own imports again when the restore imports them.
"""
from __future__ import annotations

import ast
import importlib
import sys
import warnings
from typing import Optional


def candidates(tree: ast.AST) -> tuple[str, ...]:
    """The dotted names of ``import a.b[.c]`` statements in ``tree`` (any depth)."""
    names = (alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names)
    return tuple(dict.fromkeys(name for name in names if "." in name))


def capture(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` this process has imported."""
    return [name for name in names if name in sys.modules]


def apply(saved: Optional[list[str]]) -> None:
    for name in saved or ():
        try:
            importlib.import_module(name)
        except Exception as e:  # the program's own use of it will fail, naming it; say why here
            warnings.warn(f"the checkpoint's program had imported {name}, which does not import here "
                          f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
