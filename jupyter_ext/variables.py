"""Which notebook variables a cell needs, and which it gives back.

A ``%%singularity`` cell runs in a fresh process, so the names it reads from earlier cells
must travel with it and the names it sets must come back. Both are found statically, from the
cell's syntax tree, in evaluation order: a name read before the cell itself assigns it is an
input; a name bound at the cell's top level (inside loops, ``if``, ``with``, ``try`` too, but not
inside function bodies) is an output. Where control flow makes it unclear (a branch that may
not run, a loop that may run zero times) the analysis assumes the name may still come from the
notebook: sending a variable too many is harmless, missing one is a ``NameError`` on the cluster.
"""
from __future__ import annotations

import ast
import types
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

#: Values of these types are never sent back: they cannot have changed (or are code, not data).
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range)
_CODE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


#: Calls to these builtins do not change their arguments.
_PURE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable", "chr", "complex", "dict", "dir", "divmod",
    "enumerate", "filter", "float", "format", "frozenset", "getattr", "hasattr", "hash", "hex", "id", "int",
    "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "oct", "ord", "pow", "print", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "type", "zip",
})


@dataclass(frozen=True)
class CellNames:
    """``reads``: names the cell uses before binding them (in first-use order).
    ``writes``: names the cell binds at its top level (in first-binding order).
    ``mutated``: names whose object the cell may change in place: a method is called on it
    (``losses.append``, ``opt.step``), it is called (``model(x)``), passed to a function, or
    has an attribute or item assigned. Merely reading it (``x[i]``, ``len(x)``) is not enough."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    mutated: frozenset[str] = frozenset()


def analyze(source: str, filename: str = "<cell>") -> CellNames:
    """Find a cell's free reads and top-level writes. Raises ``SyntaxError`` for invalid code."""
    tree = ast.parse(source, filename=filename)
    walker = _ModuleWalker()
    walker.block(tree.body)
    return CellNames(tuple(walker.reads), tuple(walker.writes), frozenset(_maybe_mutated(tree)))


def select_inputs(reads: Iterable[str], namespace: Mapping[str, Any], hidden: Iterable[str] = ()) -> dict[str, Any]:
    """The read names that exist in the notebook (IPython's own names excluded).

    A name that shadows a builtin in the notebook is sent; an unshadowed builtin is not."""
    hidden = set(hidden)
    return {n: namespace[n] for n in reads if n in namespace and n not in hidden and not _is_ipython_name(n)}


def globals_of_own_functions(inputs: Mapping[str, Any], namespace: Mapping[str, Any],
                              hidden: Iterable[str] = ()) -> dict[str, Any]:
    """The notebook variables that the notebook's own functions among ``inputs`` use, and the
    functions those call: ``history`` for ``def log(v): history.append(v)``.

    Such a function runs in the cell's namespace on the cluster (it reads a ``decay`` the cell
    rebinds, as in the notebook), so what it reads must be there, and what it may change in
    place must come back like what the cell changes itself."""
    hidden = set(hidden)
    found: dict[str, Any] = {}
    todo = [v for v in inputs.values() if isinstance(v, types.FunctionType) and v.__globals__ is namespace]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for name in _global_names(fn.__code__):
            if name in found or name not in namespace or name in hidden or _is_ipython_name(name):
                continue
            value = namespace[name]
            found[name] = value
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                todo.append(value)
    return found


def _global_names(code: types.CodeType) -> set[str]:
    """Names a function's code (its nested functions' included) may look up as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def returnable(value: Any) -> bool:
    """Whether an input may have been changed by the job and is worth sending back
    (a model trained in place, a list appended to); modules, functions and plain values are not."""
    return not isinstance(value, _IMMUTABLE + _CODE)


def outputs_for(names: CellNames, inputs: Mapping[str, Any], too_big: Iterable[str] = ()) -> list[str]:
    """What to ask the job to send back: everything it binds, plus the inputs it may have
    changed in place (``opt.step()``, ``losses.append(...)``), minus inputs too large to pull."""
    skip = set(too_big)
    out = [n for n in names.writes if not n.startswith("__")]
    out += [n for n, v in inputs.items()
            if n not in out and n not in skip and n in names.mutated and returnable(v)]
    return out


def _root(node: ast.AST) -> Optional[str]:
    """``model`` for ``model.fc.weight[0]``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _maybe_mutated(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            pure = isinstance(func, ast.Name) and func.id in _PURE_BUILTINS
            if isinstance(func, ast.Attribute):
                root = _root(func.value)
                if root:
                    out.add(root)
            elif isinstance(func, ast.Name) and not pure:
                out.add(func.id)
            if not pure:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    arg = arg.value if isinstance(arg, ast.Starred) else arg
                    if isinstance(arg, ast.Name):
                        out.add(arg.id)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root(node)
            if root:
                out.add(root)
    return out


def _is_ipython_name(name: str) -> bool:
    """``_``, ``__``, ``_5``, ``_i5``, ``_ih``...: IPython's history, never user data."""
    if name in ("_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "In", "Out"):
        return True
    return name.startswith("_") and (name[1:].isdigit() or (name.startswith("_i") and name[2:].isdigit()))


class _ModuleWalker:
    """Walks module-level code in evaluation order, tracking which names are bound so far."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.reads: dict[str, None] = {}
        self.writes: dict[str, None] = {}

    # -- names
    def load(self, name: str) -> None:
        if name not in self.bound and name not in self.reads:
            self.reads[name] = None

    def store(self, name: str) -> None:
        self.bound.add(name)
        self.writes.setdefault(name, None)

    # -- statements
    def block(self, stmts: Iterable[ast.stmt]) -> None:
        for s in stmts:
            self.stmt(s)

    def branches(self, *blocks: list[ast.stmt]) -> None:
        """Run alternative blocks from the same starting point; afterwards only names bound
        on every path count as bound."""
        start = set(self.bound)
        ends = []
        for blk in blocks:
            self.bound = set(start)
            self.block(blk)
            ends.append(self.bound)
        self.bound = set.intersection(*ends) if ends else start

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assign):
            self.expr(s.value)
            for t in s.targets:
                self.target(t)
        elif isinstance(s, ast.AugAssign):
            if isinstance(s.target, ast.Name):
                self.load(s.target.id)
            self.expr(s.value)
            self.target(s.target)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.expr(s.value)
            self.expr(s.annotation)
            if s.value is not None:
                self.target(s.target)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self.expr(s.iter)
            start = set(self.bound)
            self.target(s.target)
            self.branches(s.body + s.orelse, s.orelse)
            self.bound |= start
        elif isinstance(s, ast.While):
            self.expr(s.test)
            self.branches(s.body + s.orelse, s.orelse)
        elif isinstance(s, ast.If):
            self.expr(s.test)
            self.branches(s.body, s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.target(item.optional_vars)
            self.block(s.body)
        elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            start = set(self.bound)
            paths = [s.body + s.orelse]
            for h in s.handlers:
                paths.append(h)  # type: ignore[arg-type]
            ends = []
            for p in paths:
                self.bound = set(start)
                if isinstance(p, ast.ExceptHandler):
                    if p.type is not None:
                        self.expr(p.type)
                    if p.name:
                        self.store(p.name)
                    self.block(p.body)
                else:
                    self.block(p)
                ends.append(self.bound)
            self.bound = set.intersection(*ends)
            self.block(s.finalbody)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in s.decorator_list:
                self.expr(d)
            self.arguments_outer(s.args)
            if s.returns is not None:
                self.expr(s.returns)
            self.function_body(s.args, s.body)
            self.store(s.name)
        elif isinstance(s, ast.ClassDef):
            for d in s.decorator_list:
                self.expr(d)
            for b in s.bases:
                self.expr(b)
            for k in s.keywords:
                self.expr(k.value)
            self.class_body(s.body)
            self.store(s.name)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for alias in s.names:
                if alias.name != "*":
                    self.store(alias.asname or alias.name.split(".")[0])
        elif isinstance(s, ast.Delete):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    self.load(t.id)
                    self.bound.discard(t.id)
                else:
                    self.expr(t)
        elif isinstance(s, ast.Match):
            self.expr(s.subject)
            start = set(self.bound)
            ends = []
            for case in s.cases:
                self.bound = set(start)
                self.pattern(case.pattern)
                if case.guard is not None:
                    self.expr(case.guard)
                self.block(case.body)
                ends.append(self.bound)
            ends.append(start)  # no case may match
            self.bound = set.intersection(*ends)
        elif isinstance(s, (ast.Global, ast.Nonlocal)):
            pass
        else:  # Expr, Return, Raise, Assert, Pass, Break, Continue...
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def pattern(self, p: ast.AST) -> None:
        for node in ast.walk(p):
            if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                self.store(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                self.store(node.rest)
            elif isinstance(node, ast.MatchValue):
                self.expr(node.value)
            elif isinstance(node, ast.MatchClass):
                self.expr(node.cls)

    def target(self, t: ast.expr) -> None:
        if isinstance(t, ast.Name):
            self.store(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self.target(e)
        elif isinstance(t, ast.Starred):
            self.target(t.value)
        else:  # obj.attr = ... / obj[i] = ...: reads obj (and the index)
            self.expr(t)

    # -- expressions
    def expr(self, e: Optional[ast.AST]) -> None:
        if e is None:
            return
        if isinstance(e, ast.Name):
            if isinstance(e.ctx, ast.Load):
                self.load(e.id)
            else:
                self.store(e.id)
        elif isinstance(e, ast.NamedExpr):
            self.expr(e.value)
            self.store(e.target.id)
        elif isinstance(e, ast.Lambda):
            self.arguments_outer(e.args)
            self.function_body(e.args, [ast.Expr(e.body)])
        elif isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            self.comprehension(e)
        else:
            for child in ast.iter_child_nodes(e):
                self.expr(child)

    def comprehension(self, e: ast.expr) -> None:
        """The first iterable is evaluated outside; targets are local to the comprehension."""
        gens: list[ast.comprehension] = e.generators  # type: ignore[attr-defined]
        self.expr(gens[0].iter)
        local: set[str] = set()
        inner: list[ast.AST] = []
        for i, g in enumerate(gens):
            local |= _bound_names(g.target)
            if i:
                inner.append(g.iter)
            inner.extend(g.ifs)
        inner.extend([e.key, e.value] if isinstance(e, ast.DictComp) else [e.elt])  # type: ignore[attr-defined]
        for node in inner:
            for name in _free_loads(node, local):
                self.load(name)

    def arguments_outer(self, args: ast.arguments) -> None:
        """Defaults and annotations are evaluated when the function is defined."""
        for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.expr(d)
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is not None and a.annotation is not None:
                self.expr(a.annotation)

    def function_body(self, args: ast.arguments, body: list[ast.stmt]) -> None:
        """Globals a function reads are needed when it is called: count them as reads now.
        Names it declares ``global`` and assigns are writes of the cell."""
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a}
        declared_global = {n for node in _walk_scope(body) if isinstance(node, ast.Global) for n in node.names}
        local = (params | _assigned_in(body)) - declared_global
        for node in body:
            for name in _free_loads(node, local):
                self.load(name)
        for name in declared_global & _assigned_in(body):
            self.store(name)

    def class_body(self, body: list[ast.stmt]) -> None:
        local = _assigned_in(body)
        for node in body:
            for name in _free_loads(node, local):
                self.load(name)


def _bound_names(t: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _walk_scope(nodes: Iterable[ast.AST]):
    """``ast.walk`` that stays in one scope: a nested function, lambda or class yields itself
    (its name is bound here) and what is evaluated here (decorators, defaults, bases), not its
    body; a comprehension's loop variables are its own."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(getattr(node, "decorator_list", []))
            stack.extend(node.args.defaults + [d for d in node.args.kw_defaults if d is not None])
        elif isinstance(node, ast.ClassDef):
            stack.extend(node.decorator_list + node.bases + [k.value for k in node.keywords])
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for g in node.generators:
                stack.append(g.iter)
                stack.extend(g.ifs)
            stack.extend([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt])
        else:
            stack.extend(ast.iter_child_nodes(node))


def _assigned_in(body: list[ast.stmt]) -> set[str]:
    """Names a function (or class) body binds in its own scope."""
    out: set[str] = set()
    for node in _walk_scope(body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            out.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.add(node.rest)
    return out


def _free_loads(node: ast.AST, local: set[str]) -> list[str]:
    """Names loaded in ``node`` (descending into nested scopes) that are not local to it."""
    out: list[str] = []

    def visit(n: ast.AST, bound: set[str]) -> None:
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, ast.Load) and n.id not in bound:
                out.append(n.id)
            return
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = n.args
            for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
                visit(d, bound)
            for dec in getattr(n, "decorator_list", []):
                visit(dec, bound)
            params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a}
            body = n.body if isinstance(n.body, list) else [ast.Expr(n.body)]
            glob = {x for s in _walk_scope(body) if isinstance(s, ast.Global) for x in s.names}
            inner = (bound | params | _assigned_in(body)) - glob
            for s in body:
                visit(s, inner)
            return
        if isinstance(n, ast.ClassDef):
            for part in n.decorator_list + n.bases + [k.value for k in n.keywords]:
                visit(part, bound)
            inner = bound | _assigned_in(n.body)
            for s in n.body:
                visit(s, inner)
            return
        if isinstance(n, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = set(bound)
            for g in n.generators:
                visit(g.iter, inner)
                inner |= _bound_names(g.target)
                for cond in g.ifs:
                    visit(cond, inner)
            for part in ([n.key, n.value] if isinstance(n, ast.DictComp) else [n.elt]):
                visit(part, inner)
            return
        for child in ast.iter_child_nodes(n):
            visit(child, bound)

    visit(node, local)
    return out
