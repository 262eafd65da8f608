"""Static name analysis of the submitted code.

Used to decide soundly, without running anything, (a) whether a loop's iterable expression may
be re-evaluated on restore (none of its names can change while the loop runs) and (b) whether an
unpicklable variable can be rebuilt by re-running the one statement that created it.
"""
from __future__ import annotations

import ast
from typing import Iterable

class _Binder(ast.NodeVisitor):
    """Collects the names a statement binds in the scope it runs in."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.names.add(node.id)

    def _scope(self, node: ast.AST) -> None:
        name = getattr(node, "name", None)
        if name:
            self.names.add(name)
        for deco in getattr(node, "decorator_list", []):
            self.visit(deco)
        args = getattr(node, "args", None)
        if isinstance(args, ast.arguments):
            for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
                self.visit(d)
        for base in getattr(node, "bases", []):
            self.visit(base)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)

    def _comprehension(self, node: ast.AST) -> None:
        # only walrus targets leak out of a comprehension's own scope
        for sub in ast.walk(node):
            if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
                self.names.add(sub.target.id)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.names.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self.names.add(alias.asname or alias.name)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.names.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self.names.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self.names.add(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest:
            self.names.add(node.rest)
        self.generic_visit(node)


def bound_names(nodes: ast.AST | Iterable[ast.AST]) -> set[str]:
    """Names bound (assigned, imported, defined, deleted) by ``nodes`` in their own scope."""
    binder = _Binder()
    for node in ([nodes] if isinstance(nodes, ast.AST) else nodes):
        binder.visit(node)
    return binder.names


def loaded_names(node: ast.AST) -> set[str]:
    """Every name read anywhere inside ``node`` (nested scopes included: conservative)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def declared_global(tree: ast.AST) -> set[str]:
    """Names that some nested function or class declares ``global`` or ``nonlocal``.

    Calling such a function can rebind the name behind our back, so those names are never
    treated as stable.
    """
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def has_dynamic_parts(node: ast.AST) -> bool:
    """True if evaluating ``node`` twice could differ for reasons we cannot see (walrus, yield...)."""
    return any(isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) for n in ast.walk(node))


def is_simple_binding(stmt: ast.stmt) -> bool:
    """Statements a restore may re-run to rebuild a variable (ElasticNotebook-style)."""
    if isinstance(stmt, ast.Assign):
        return not has_dynamic_parts(stmt.value)
    if isinstance(stmt, ast.AnnAssign):
        return stmt.value is not None and not has_dynamic_parts(stmt.value)
    return isinstance(stmt, (ast.Import, ast.ImportFrom))
