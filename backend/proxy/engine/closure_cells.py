"""Variables a function's closures share: kept in one object, so a restored frame shares them too.

A restore rebuilds a frame by calling its function again and loading the saved locals into the
new frame. A variable that a nested function (a ``def``, a lambda, a generator expression) reads
lives in a cell, and the new frame gets new cells while the restored closures keep theirs: had the
function rebound such a variable after the restore, the closures would have gone on seeing the
old value, silently. So such a function ran unchanged, with no safe point inside, and the
commonest shape of all had one: ``for step in range(n): def closure(): ...; opt.step(closure)``
(LBFGS, SAM, a lambda handed to ``checkpoint``), whose closure reads the loop's ``x``/``y``/``step``.

`box` rewrites those variables into attributes of one `Cells` object, bound once at the start
of the function (``step`` becomes ``__sg_cells__.step`` in the function and in the nested scopes
that read it, ``nonlocal step`` is dropped): the object is saved once, and after a restore the
frame and its closures share it as they shared the cells. A cell is exactly such a box, so the
program computes the same; only ``locals()`` shows ``__sg_cells__`` instead of the names, so a
function that calls ``locals()``, ``vars()``, ``eval`` or ``exec`` is left as it was. Names bound
in ways an attribute cannot be (``import``, ``except ... as``, ``def``, ``class``, ``match``,
``:=``) or used by a nested class body are left too, and the function runs unchanged as before.
"""
from __future__ import annotations

import ast
from typing import Any, Iterable

from .analysis import (bound_names, closures_sharing, function_locals, own_scope, parameters,
                       shared_variables)

#: the local that holds the shared variables (bound once, so closures may share it)
BOX = "__sg_cells__"  # ends in `__`: a method does not mangle it
_INTROSPECTION = ("locals", "vars", "eval", "exec")


class Cells:
    """The shared variables of one call of a function; an unset one reads as Python's unbound cell."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # pickle and copy look for optional hooks
        raise NameError(f"cannot access free variable '{name}' where it is not associated with a value "
                        f"in enclosing scope")


def box_shared(fdef: ast.FunctionDef) -> tuple[str, set[str]]:
    """Box the variables ``fdef``'s closures share and it rebinds (`analysis.closures_sharing`):
    ``("", the names)`` when done or when there are none; else ``(why it must run unchanged,
    set())``, ``fdef`` unchanged."""
    why = closures_sharing(fdef)
    if not why:
        return "", set()
    shared = shared_variables(fdef)
    blocked = box(fdef, shared) if shared <= set(function_locals(fdef)) \
        else "a nested function rebinds a variable of an enclosing function"
    return (f"{why} ({blocked})", set()) if blocked else ("", shared)


def box(fdef: ast.FunctionDef, names: Iterable[str]) -> str:
    """Rewrite ``fdef`` in place so that ``names`` live in a `Cells` object; '' when done, else
    why it cannot be (and ``fdef`` is unchanged)."""
    names = set(names)
    why = _obstacle(fdef, names)
    if why:
        return why
    boxer = _Boxer(names)
    fdef.body = [boxer.visit(stmt) for stmt in fdef.body]
    first = fdef.body[0]
    head = [ast.Assign(targets=[ast.Name(id=BOX, ctx=ast.Store())],
                       value=ast.Call(func=ast.Attribute(value=ast.Name(id="__sg_rt__", ctx=ast.Load()),
                                                         attr="Cells", ctx=ast.Load()), args=[], keywords=[]))]
    for p in parameters(fdef):
        if p in names:  # a parameter the closures share starts as the argument
            head.append(ast.Assign(targets=[_attribute(p, ast.Store())], value=ast.Name(id=p, ctx=ast.Load())))
    docstring = 1 if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
        and isinstance(first.value.value, str) and len(fdef.body) > 1 else 0
    for stmt in head:
        ast.copy_location(stmt, fdef.body[docstring])
    fdef.body[docstring:docstring] = head
    ast.fix_missing_locations(fdef)
    return ""


def _obstacle(fdef: ast.FunctionDef, names: set[str]) -> str:
    for node in own_scope(fdef):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _INTROSPECTION:
            return f"it calls {node.func.id}(), which would not see the variables its closures share"
        bound = _unboxable_binding(node)
        if bound & names:
            return f"a closure shares `{sorted(bound & names)[0]}`, which the function binds with {type(node).__name__}"
    for node in ast.walk(fdef):
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name) and node.target.id in names:
            return f"a closure shares `{node.target.id}`, which `:=` binds"
        if isinstance(node, ast.ClassDef) and node is not fdef and any(
                isinstance(n, ast.Name) and n.id in names for n in ast.walk(node)):
            return f"a class defined inside it uses `{sorted(names)[0]}`, which its closures share"
        if isinstance(node, ast.Global) and names & set(node.names):
            return f"a nested function declares `global {sorted(names & set(node.names))[0]}`"
    return ""


def _unboxable_binding(node: ast.AST) -> set[str]:
    """Names ``node`` binds in a way an attribute target cannot."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ExceptHandler) and node.name:
        return {node.name}
    if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        return {node.name}
    if isinstance(node, ast.MatchMapping) and node.rest:
        return {node.rest}
    return set()


def _attribute(name: str, ctx: ast.expr_context) -> ast.Attribute:
    return ast.Attribute(value=ast.Name(id=BOX, ctx=ast.Load()), attr=name, ctx=ctx)


def _own_locals(scope: ast.AST) -> set[str]:
    """The names a nested function or lambda binds itself (parameters, assignments), less those it
    declares ``nonlocal`` or ``global``."""
    args = scope.args  # type: ignore[attr-defined]
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
              + [v for v in (args.vararg, args.kwarg) if v]}
    if isinstance(scope, ast.Lambda):
        return params
    declared = {n for node in own_scope(scope) if isinstance(node, (ast.Nonlocal, ast.Global)) for n in node.names}
    return (params | bound_names(scope.body)) - declared  # type: ignore[attr-defined]


class _Boxer(ast.NodeTransformer):
    """Replaces the boxed names where they mean the function's variables (not where a nested scope
    binds its own), and drops them from nested ``nonlocal`` statements."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        """``total: int = 0`` of a boxed variable: an attribute target cannot be a simple annotated
        one, and Python never evaluates a local's annotation, so it becomes a plain assignment
        (``total: int`` alone, which assigns nothing, becomes ``pass``)."""
        if not (isinstance(node.target, ast.Name) and node.target.id in self.names):
            return self.generic_visit(node)
        if node.value is None:
            return ast.copy_location(ast.Pass(), node)
        assign = ast.Assign(targets=[ast.copy_location(_attribute(node.target.id, ast.Store()), node.target)],
                            value=self.visit(node.value))
        return ast.copy_location(assign, node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.names:
            return ast.copy_location(_attribute(node.id, node.ctx), node)
        return node

    def _inside(self, names: set[str], nodes: list) -> list:
        saved, self.names = self.names, names
        try:
            return [self.visit(n) for n in nodes]
        finally:
            self.names = saved

    def _function(self, node: ast.AST) -> ast.AST:
        # decorators, defaults and annotations are evaluated where the function is made
        args = node.args  # type: ignore[attr-defined]
        args.defaults = [self.visit(d) for d in args.defaults]
        args.kw_defaults = [None if d is None else self.visit(d) for d in args.kw_defaults]
        if not isinstance(node, ast.Lambda):
            node.decorator_list = [self.visit(d) for d in node.decorator_list]  # type: ignore[attr-defined]
            for a in args.posonlyargs + args.args + args.kwonlyargs + [v for v in (args.vararg, args.kwarg) if v]:
                if a.annotation is not None:
                    a.annotation = self.visit(a.annotation)
            if node.returns is not None:  # type: ignore[attr-defined]
                node.returns = self.visit(node.returns)  # type: ignore[attr-defined]
        inner = self.names - _own_locals(node)
        if isinstance(node, ast.Lambda):
            node.body = self._inside(inner, [node.body])[0]
            return node
        node.body = self._inside(inner, node.body)  # type: ignore[attr-defined]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Nonlocal(self, node: ast.Nonlocal) -> ast.stmt:
        """A nested function's ``nonlocal`` of a boxed variable: it assigns the attribute instead."""
        kept = [n for n in node.names if n not in self.names]
        if not kept:
            return ast.copy_location(ast.Pass(), node)
        node.names = kept
        return node

    def _comprehension(self, node: ast.AST) -> ast.AST:
        gens = node.generators  # type: ignore[attr-defined]
        gens[0].iter = self.visit(gens[0].iter)  # the first iterable is evaluated outside
        targets = {n.id for g in gens for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = self.names - targets
        for i, g in enumerate(gens):
            g.target = self._inside(inner, [g.target])[0]
            if i:
                g.iter = self._inside(inner, [g.iter])[0]
            g.ifs = self._inside(inner, g.ifs)
        for field in ("elt", "key", "value"):
            if hasattr(node, field):
                setattr(node, field, self._inside(inner, [getattr(node, field)])[0])
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension
