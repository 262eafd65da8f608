"""Static name analysis of the submitted code.

Used to decide soundly, without running anything, (a) whether a loop's iterable expression may
be re-evaluated on restore (none of its names can change while the loop runs) and (b) whether an
unpicklable variable can be rebuilt by re-running the one statement that created it.
"""
from __future__ import annotations

import ast
import builtins
import importlib.util
import symtable
from typing import Iterable, Iterator, Optional

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


def statement_reads(stmt: ast.stmt) -> set[str]:
    """The names running ``stmt`` reads: a ``def`` reads its decorators, defaults and annotations
    (its body reads its names when called, whenever the function was made)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set().union(*(loaded_names(n) for n in stmt.decorator_list + [stmt.args]),
                           loaded_names(stmt.returns) if stmt.returns is not None else set())
    return loaded_names(stmt)


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
    if isinstance(stmt, ast.FunctionDef):  # `@torch.jit.script def f(...)`: compiled again
        return not any(has_dynamic_parts(node) for node in stmt.decorator_list + [stmt.args])
    return isinstance(stmt, (ast.Import, ast.ImportFrom))


# --------------------------------------------------------------------------- functions of the program
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
           ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
#: nested scopes that outlive the statement creating them (a comprehension runs at once)
_CLOSURES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.GeneratorExp)
#: decorators whose function must keep its own bytecode (they compile or trace it)
_COMPILERS = ("compile", "jit", "script", "trace")


def own_scope(fdef: ast.AST) -> Iterator[ast.AST]:
    """Every node of a function's body that runs in its own scope (nested scopes excluded)."""
    stack = list(reversed(getattr(fdef, "body", [])))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def parameters(fdef: ast.FunctionDef) -> list[str]:
    a = fdef.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]]


def function_locals(fdef: ast.FunctionDef) -> list[str]:
    """The names a function binds in its own frame (parameters first), not global/nonlocal ones."""
    declared = {n for node in own_scope(fdef) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    names = list(dict.fromkeys(parameters(fdef) + sorted(bound_names(fdef.body))))
    return [n for n in names if n not in declared]


def _binding_counts(fdef: ast.FunctionDef) -> dict[str, int]:
    """How often each name is bound in the function's own scope; a binding inside a loop counts twice."""
    counts: dict[str, int] = {p: 1 for p in parameters(fdef)}

    def bind(name: str, weight: int) -> None:
        counts[name] = counts.get(name, 0) + weight

    def visit(node: ast.AST, weight: int) -> None:
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bind(node.id, weight)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, weight)
            return
        elif isinstance(node, _SCOPES):
            for sub in ast.walk(node):  # only := leaks out of a comprehension
                if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
                    bind(sub.target.id, 2)
            return
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bind(alias.asname or alias.name.split(".")[0], weight)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bind(node.name, weight)
        inner = 2 if isinstance(node, (ast.For, ast.While, ast.AsyncFor)) else weight
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for stmt in fdef.body:
        visit(stmt, 1)
    return counts


def is_generator(fdef: ast.AST) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in own_scope(fdef))


def not_rewritable(fdef: ast.AST) -> str:
    """Why a function must run unchanged (no safe points inside it), or '' when it can be rewritten.

    Generators and coroutines suspend with their loops half done, compilers read the function's
    own bytecode, and a frame whose closures share a variable it rebinds cannot be rebuilt: a
    restored frame gets new cells, its restored closures keep theirs.
    """
    if not isinstance(fdef, ast.FunctionDef):
        return "async functions run unchanged"
    if is_generator(fdef) or any(isinstance(n, ast.Await) for n in own_scope(fdef)):
        return "generator functions run unchanged"
    for deco in fdef.decorator_list:
        text = ast.unparse(deco)
        if any(word in text for word in _COMPILERS):
            return f"decorated with @{text}, which compiles or traces its bytecode"
    return closures_sharing(fdef)


def _sharing(fdef: ast.FunctionDef) -> tuple[list[ast.Nonlocal], list[str]]:
    """The ``nonlocal`` statements of ``fdef``'s nested functions, and the variables a closure
    reads that ``fdef`` rebinds (sorted)."""
    nested = [n for n in own_scope(fdef) if isinstance(n, _CLOSURES)]
    nonlocals = [n for scope in nested for n in ast.walk(scope) if isinstance(n, ast.Nonlocal)]
    own = _own_locals(fdef)
    if own is not None:  # a counter factory's ``nonlocal n`` rebinds the factory's variable, not fdef's
        nonlocals = [n for n in nonlocals if own & set(n.names)]
    if not nested and not any(isinstance(n, ast.ClassDef) for n in own_scope(fdef)):
        return nonlocals, []
    counts = _binding_counts(fdef)
    captured = _captured_by_closures(fdef)
    if captured is None:  # no symbol table for it alone: every name a closure mentions
        captured = {n.id for scope in nested for n in ast.walk(scope) if isinstance(n, ast.Name)}
    return nonlocals, sorted(name for name in captured & set(counts) if counts[name] > 1)


def shared_variables(fdef: ast.FunctionDef) -> set[str]:
    """The variables `closures_sharing` speaks of, nested ``nonlocal`` ones included
    (`closure_cells.box` moves them into one object)."""
    nonlocals, shared = _sharing(fdef)
    return {name for n in nonlocals for name in n.names} | set(shared)


def closures_sharing(fdef: ast.FunctionDef) -> str:
    """Why closures keep ``fdef``'s frame from being rebuilt (a variable they share that it
    rebinds, or a nested ``nonlocal``), or ''."""
    nonlocals, shared = _sharing(fdef)
    if nonlocals:
        return f"a nested function rebinds `nonlocal {', '.join(nonlocals[0].names)}`"
    if shared:
        return f"a closure shares {', '.join(shared)}, which the function rebinds"
    return ""


_COMPREHENSION_TABLES = ("listcomp", "setcomp", "dictcomp")


def _table(fdef: ast.FunctionDef) -> Optional[symtable.SymbolTable]:
    """Python's own symbol table of ``fdef`` alone (None when it has none on its own)."""
    try:
        return symtable.symtable(ast.unparse(fdef), "<function>", "exec").get_children()[0]
    except (SyntaxError, IndexError, ValueError):
        return None


def _own_locals(fdef: ast.FunctionDef) -> Optional[set[str]]:
    table = _table(fdef)
    return None if table is None else {name for name in table.get_identifiers() if table.lookup(name).is_local()}


def _captured_by_closures(fdef: ast.FunctionDef) -> Optional[set[str]]:
    """The variables of ``fdef`` that a nested function, lambda or generator expression closes
    over: their free variables per Python's own symbol table, so a closure's own locals (a
    ``loss`` inside an LBFGS ``closure()`` beside a ``loss`` of the loop that calls it) are not
    taken for shared ones. ``None`` when the function has no symbol table on its own."""
    table = _table(fdef)
    if table is None:
        return None
    own = {name for name in table.get_identifiers() if table.lookup(name).is_local()}
    free: set[str] = set()
    stack = list(table.get_children())
    while stack:
        child = stack.pop()
        if child.get_type() == "function" and child.get_name() not in _COMPREHENSION_TABLES:
            free.update(child.get_frees())
        stack.extend(child.get_children())
    return free & own


def library_roots(tree: ast.AST) -> set[str]:
    """Names that can only mean library code: bound by imports alone, or builtins never rebound."""
    imported: set[str] = set()
    other: set[str] = set()
    star = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    star = True
                else:
                    imported.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            other.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            other.add(node.name)
        elif isinstance(node, ast.arg):
            other.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            other.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            other.add(node.name)
    roots = imported - other
    if not star:
        roots |= set(dir(builtins)) - other - imported
    return roots


def names_of_modules(tree: ast.AST, module: str, modules: frozenset[str]) -> set[str]:
    """The names ``tree`` (the source of ``module``) binds by importing one of ``modules``:
    ``from a.b import c`` and ``import a.b.c as c`` for ``a.b.c``, relative imports included."""
    found: set[str] = set()
    if not modules:
        return found
    package = module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            except (ImportError, ValueError):  # beyond the top-level package: it cannot import one
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    found.add(alias.asname)
    return found


def _private(name: str) -> bool:
    return name.startswith("__") and not name.endswith("__")


def callee_root(func: ast.expr) -> Optional[str]:
    """The root name of ``a.b.c`` (or ``a``), when a call's callee is such a chain without mangled names."""
    while isinstance(func, ast.Attribute):
        if _private(func.attr):
            return None
        func = func.value
    if isinstance(func, ast.Name) and not _private(func.id):
        return func.id
    return None


def method_of_temporary(func: ast.expr) -> bool:
    """A callee like ``Trainer(cfg).fit`` or ``runs[0].fit``: a method of an object no name
    holds. A restore re-enters it through the receiver saved in the method's frame (its first
    argument), without evaluating the receiver's expression again. Not ``super().fit``: there the
    receiver's own ``fit`` is another function."""
    if not isinstance(func, ast.Attribute) or _private(func.attr) or callee_root(func.value) is not None:
        return False
    inner = func.value
    return not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super")


def is_pure(e: ast.expr, unstable: set[str] | frozenset[str]) -> bool:
    """An expression that evaluates again to the same objects, with no side effects, after a call
    in the same statement returned (so a restore may evaluate it a second time)."""
    if isinstance(e, ast.Constant):
        return True
    if isinstance(e, ast.Name):
        return e.id not in unstable
    if isinstance(e, ast.Starred):
        return is_pure(e.value, unstable)
    if isinstance(e, ast.FormattedValue):
        return is_pure(e.value, unstable) and (e.format_spec is None or is_pure(e.format_spec, unstable))
    if isinstance(e, ast.JoinedStr):
        return all(is_pure(v, unstable) for v in e.values)
    return False
