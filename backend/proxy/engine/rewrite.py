"""The AST rewrite that makes every loop of the submitted code resumable.

Scope: the statements of a module (a cell or a script) or of one submitted function's body, and
recursively the bodies of ``for``/``while``, both branches of ``if``, the body of ``with`` and the
body of ``try``.  Code inside ``def``/``class``/lambdas/comprehensions, ``except``/``finally``
blocks, loop ``else`` blocks and ``match`` runs unchanged: it completes before the next safe point.

What the rewrite produces (``R`` is ``__sg_rt.restoring``, a plain attribute):

* every plain statement run is guarded ``if not R:`` so a restore skips what already ran;
* every compound statement that contains a loop ("tracked") is guarded
  ``if not R or __sg_rt.go(ID):`` so a restore enters only the one on the recorded path;
* ``for T in E`` becomes ``for T in __sg_rt.enter_for(ID, None if R else SRC(E), MAKERS)`` inside
  ``try/finally: __sg_rt.pop(ID)``; the returned frame counts items and its ``__next__`` is the
  safe point.  ``SRC`` keeps ``enumerate``/``zip``/``iter`` apart so the iterators they wrap can be
  rebuilt one by one, and ``MAKERS`` are lambdas that re-evaluate a sub-expression (only where
  the loop cannot change the names it reads);
* ``while C`` becomes ``while __sg_fID.tick() or C`` (``tick`` returns True only to re-enter
  the body of a loop a restore resumes inside, without re-testing ``C``);
* ``if C`` records the branch it took (``enter_if``); a restore takes the recorded branch;
* ``with`` gets a first context manager that pushes a frame, and its headers are re-entered on
  restore; ``try`` bodies push a frame, handlers re-raise `Preempted` first, and ``finally``
  blocks are skipped while a preemption unwinds;
* between two top-level statements a boundary safe point is inserted.

Original line numbers are kept, so tracebacks point into the submitted source.
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from typing import Optional

from . import closure_cells, generator_rewrite, library_wrappers, spawned
from .analysis import (bound_names, callee_root, closures_sharing, declared_global, function_locals,
                       has_dynamic_parts, is_generator, is_pure, is_simple_binding, library_roots, loaded_names,
                       method_of_temporary, names_of_modules, not_rewritable, parameters, statement_reads)
from .library_patches import imported_names

#: the runtime's name in generated code; it ends in ``__`` so that methods do not mangle it
RT = "__sg_rt__"
PREFIX = "__sg_"
REWRITE_VERSION = 3  # bumped whenever generated code or node numbering changes: old checkpoints are refused
#: a constant in each rewritten function's code naming its function id (see `DefInfo`)
MARKER = "\x00sg-def:"
#: statements whose value may be a call a restore re-enters
_CALL_STATEMENTS = (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return)
_SPECIAL = ("enumerate", "zip", "iter")


@dataclass(frozen=True)
class LeafInfo:
    """One sub-expression of a ``for`` loop's iterable (see `rewrite._Rewriter._src`)."""

    text: str
    reevaluable: bool
    why_not: str


@dataclass
class NodeInfo:
    """A tracked statement or boundary, identified by a stable id in pre-order."""

    id: int
    kind: str  # for | while | if | with | try | boundary | call
    line: int
    top_index: int
    with_targets: tuple[str, ...] = ()
    leaves: tuple[LeafInfo, ...] = ()
    #: the function (`DefInfo.id`) whose body holds the statement; 0 is the top level
    func: int = 0
    #: for a call: the callee expression's source (``self.fit``), evaluated to check a frame's callee
    callee: str = ""
    #: for a call of a method on an object no name holds (``Trainer(cfg).fit()``): the method's
    #: name; the receiver is the callee frame's first argument, never evaluated again
    method: str = ""
    #: for a call: whether it passes no arguments (``main()``; `library_wrappers`: a click command)
    bare: bool = False
    #: for a runner's call (``fire.Fire(main)``, `library_wrappers`): its first argument's source
    runs: str = ""


@dataclass(frozen=True)
class DefInfo:
    """A function of the submitted code whose body was rewritten (loops are safe points inside it)."""

    id: int
    name: str
    line: int
    local_names: tuple[str, ...]
    #: its first parameter (a method's ``self``): where ``Trainer(cfg).fit()`` finds its receiver
    receiver: str = ""


@dataclass(frozen=True)
class StmtInfo:
    """A top-level (or function-body-level) statement, for rebuild analysis."""

    node: ast.stmt
    bound: frozenset[str]
    reads: frozenset[str]
    simple: bool


@dataclass
class Rewritten:
    tree: ast.Module
    nodes: dict[int, NodeInfo]
    statements: list[StmtInfo]
    unstable: frozenset[str]
    has_safe_points: bool
    returns_last_expr: bool = False
    local_names: tuple[str, ...] = field(default_factory=tuple)
    #: rewritten functions by id, and why the others run unchanged (line -> reason)
    defs: dict[int, DefInfo] = field(default_factory=dict)
    unchanged_defs: dict[int, str] = field(default_factory=dict)
    #: per function id: the source span ``(line, end line, col, end col)`` of each call site -> its node id
    call_spans: dict[int, dict[tuple, int]] = field(default_factory=dict)


# --------------------------------------------------------------------------- node helpers
def _name(id_: str, store: bool = False) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Store() if store else ast.Load())


def _rt_attr(attr: str) -> ast.Attribute:
    return ast.Attribute(value=_name(RT), attr=attr, ctx=ast.Load())


def _rt_call(method: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=_rt_attr(method), args=list(args), keywords=[])


def _const(v: object) -> ast.Constant:
    return ast.Constant(value=v)


def _restoring() -> ast.Attribute:
    return _rt_attr("restoring")


def _pop(nid: int) -> ast.Expr:
    return ast.Expr(value=_rt_call("pop", _const(nid)))


def _try_finally(body: list[ast.stmt], final: list[ast.stmt]) -> ast.Try:
    return ast.Try(body=body, handlers=[], orelse=[], finalbody=final)


def _fill_locations(node: ast.AST, src: ast.AST) -> None:
    """Give generated nodes the position of the statement they replace."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes and getattr(sub, "lineno", None) is None:
            sub.lineno = src.lineno  # type: ignore[attr-defined]
            sub.col_offset = src.col_offset  # type: ignore[attr-defined]
            sub.end_lineno = getattr(src, "end_lineno", src.lineno)  # type: ignore[attr-defined]
            sub.end_col_offset = getattr(src, "end_col_offset", src.col_offset)  # type: ignore[attr-defined]


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _statement_infos(body: list[ast.stmt]) -> list[StmtInfo]:
    infos = []
    for stmt in body:
        original = copy.deepcopy(stmt)
        infos.append(StmtInfo(original, frozenset(bound_names(original)),
                              frozenset(statement_reads(original)), is_simple_binding(original)))
    return infos


def _prologue(fid: int, local_names: list[str], params: set[str]) -> list[ast.stmt]:
    """``__sg_P = None; if R: __sg_P = rt.arrive(marker); if __sg_P is None: <load saved locals>``.

    `Runtime.arrive` answers None when a restore re-enters this very call (its saved locals are
    then loaded, arguments included), else it pauses the restore for the duration of this call
    (a ``with`` header or a re-created iterator calling a function) and returns the token that
    the function's ``finally`` hands back to `Runtime.resume`.
    """
    token = f"{PREFIX}P"
    loads: list[ast.stmt] = [ast.Assign(targets=[_name(f"{PREFIX}L", store=True)], value=_rt_call("frame_locals"))]
    for name in local_names:
        saved = ast.Subscript(value=_name(f"{PREFIX}L"), slice=_const(name), ctx=ast.Load())
        test = ast.Compare(left=_const(name), ops=[ast.In()], comparators=[_name(f"{PREFIX}L")])
        orelse: list[ast.stmt] = [ast.Delete(targets=[ast.Name(id=name, ctx=ast.Del())])] if name in params else []
        loads.append(ast.If(test=test, body=[ast.Assign(targets=[_name(name, store=True)], value=saved)],
                            orelse=orelse))
    arrive = ast.Assign(targets=[_name(token, store=True)], value=_rt_call("arrive", _const(f"{MARKER}{fid}")))
    on_restore = [arrive, ast.If(test=ast.Compare(left=_name(token), ops=[ast.Is()], comparators=[_const(None)]),
                                 body=loads, orelse=[])]
    return [ast.Assign(targets=[_name(token, store=True)], value=_const(None)),
            ast.If(test=_restoring(), body=on_restore, orelse=[])]


def runner_argument(call: ast.Call, unstable: frozenset[str] | set[str]) -> Optional[str]:
    """For ``fire.Fire(main)``, ``typer.run(main)``: the name of the function it is given. A restore
    makes such a library call again with the same arguments (`library_wrappers`), so they must
    evaluate again to the same objects; None for any other call."""
    if ast.unparse(call.func) not in library_wrappers.RUNNER_CALLEES or not call.args \
            or not isinstance(call.args[0], ast.Name) or any(isinstance(a, ast.Starred) for a in call.args) \
            or any(k.arg is None for k in call.keywords) \
            or not all(is_pure(a, unstable) for a in [*call.args, *(k.value for k in call.keywords)]):
        return None
    return call.args[0].id


# --------------------------------------------------------------------------- the rewriter
class _Rewriter:
    def __init__(self, unstable: set[str], library: Optional[set[str]] = None, base: int = 0) -> None:
        self.unstable = unstable
        #: first node id and function id (a library module's ids lie in a range of their own)
        self.base = base
        #: names that only mean library code; None: no call sites (a submitted callable's body)
        self.library = library
        self.nodes: dict[int, NodeInfo] = {}
        self.defs: dict[int, DefInfo] = {}
        self.unchanged_defs: dict[int, str] = {}
        self.call_spans: dict[int, dict[tuple, int]] = {}
        self.top_index = 0
        self.func = 0
        self._tracked: dict[int, bool] = {}
        self._calls: dict[int, list[ast.Call]] = {}
        self._with_names: list[set[str]] = []  # `as` targets of the enclosing tracked with statements

    def _new(self, kind: str, stmt: ast.AST, **extra: object) -> NodeInfo:
        info = NodeInfo(self.base + len(self.nodes), kind, stmt.lineno, self.top_index, func=self.func,  # type: ignore[arg-type]
                        **extra)  # type: ignore[arg-type]
        self.nodes[info.id] = info
        return info

    # functions -------------------------------------------------------------
    def functions(self, tree: ast.AST) -> None:
        """Rewrite, in place, the body of every function the submitted code defines (at any depth)."""
        rewriter = self

        class Defs(ast.NodeTransformer):
            in_function = 0
            classes: list[str] = []  # the classes around, innermost last

            def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
                self.classes.append(node.name)
                try:
                    self.generic_visit(node)
                finally:
                    self.classes.pop()
                return node

            def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
                reason = not_rewritable(node)
                if reason and reason == closures_sharing(node) and not is_generator(node):
                    # only its closures' cells stand in the way: share them through one object
                    reason = closure_cells.box_shared(node)[0] or not_rewritable(node)
                if reason and is_generator(node) and not self.in_function:
                    # a module-level generator (or a method's): resumable where it suspends
                    reason = generator_rewrite.rewrite(node, self.classes[-1] if self.classes else "") or ""
                if reason:
                    rewriter.unchanged_defs[node.lineno] = reason
                    return node
                if is_generator(node):
                    return node
                self.in_function += 1
                try:
                    self.generic_visit(node)  # nested functions first
                finally:
                    self.in_function -= 1
                rewriter.function(node)
                return node

            def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
                rewriter.unchanged_defs[node.lineno] = not_rewritable(node)
                return node

        Defs().visit(tree)

    def function(self, fdef: ast.FunctionDef) -> None:
        """Rewrite one function's body like the top level, behind a prologue that restores its locals."""
        if not self.any_tracked(fdef.body):
            return  # no loop and no call that can lead to one: runs unchanged, at no cost
        fid = self.base + len(self.defs) + 1
        local_names = function_locals(fdef)
        positional = fdef.args.posonlyargs + fdef.args.args
        self.defs[fid] = DefInfo(fid, fdef.name, fdef.lineno, tuple(local_names),
                                 positional[0].arg if positional else "")
        saved = self.func, self.top_index, self._with_names
        self.func, self.top_index, self._with_names = fid, -1, []
        try:
            body = list(fdef.body)
            head = 1 if body and _is_docstring(body[0]) and len(body) > 1 else 0
            rest = self.block(body[head:])
        finally:
            self.func, self.top_index, self._with_names = saved
        prologue = _prologue(fid, local_names, set(parameters(fdef)))
        token = _name(f"{PREFIX}P")
        resume = ast.If(test=ast.Compare(left=token, ops=[ast.IsNot()], comparators=[_const(None)]),
                        body=[ast.Expr(value=_rt_call("resume", _name(f"{PREFIX}P")))], orelse=[])
        new = body[:head] + prologue + [_try_finally(rest, [resume])]
        first = body[head] if len(body) > head else body[0]
        for n in new[head:]:
            _fill_locations(n, first)
        fdef.body = new

    # call sites ------------------------------------------------------------
    def calls(self, s: ast.stmt) -> list[ast.Call]:
        """The calls of statement ``s`` a restore can re-enter, in evaluation order.

        The statement's own value (``f(x)``, ``y = f(x)``, ``return f(x)``...) when its callee is
        a plain name or attribute chain that is not a library name; and calls in the arguments of
        such a call or an f-string, when everything evaluated before them is `is_pure` (a restore
        evaluates those again, but not the arguments of the call it re-enters).
        """
        key = id(s)
        if key in self._calls:
            return self._calls[key]
        found: list[ast.Call] = []
        value: Optional[ast.expr] = None
        if self.library is not None and isinstance(s, _CALL_STATEMENTS):
            value = getattr(s, "value", None)
            if isinstance(s, ast.AugAssign) and not (isinstance(s.target, ast.Name)
                                                    and s.target.id not in self.unstable):
                value = None
        if value is not None:
            self._path_calls(value, found)
        self._calls[key] = found
        return found

    def _path_calls(self, e: ast.expr, out: list[ast.Call]) -> None:
        assert self.library is not None
        parts: list[ast.expr]
        if isinstance(e, ast.Call):
            root = callee_root(e.func)
            if root is None:
                if method_of_temporary(e.func):
                    out.append(e)
                return
            if root not in self.library or runner_argument(e, self.unstable):
                out.append(e)
            through = isinstance(e.func, ast.Name) or (
                isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Name))
            if not through or root in self.unstable:
                return
            parts = list(e.args) + [k.value for k in e.keywords]
        elif isinstance(e, ast.JoinedStr):
            parts = list(e.values)
        elif isinstance(e, ast.FormattedValue):
            parts = [e.value]
        else:
            return
        for part in parts:
            if is_pure(part, self.unstable):
                continue
            self._path_calls(part, out)
            break  # what follows an impure part runs after it: never re-entered

    def _call_statement(self, s: ast.stmt) -> tuple[ast.expr, list[ast.stmt]]:
        """Give each re-enterable call of ``s`` an id; returns the statement's guard and itself."""
        calls = {id(c): c for c in self.calls(s)}
        ids: list[int] = []
        rewriter = self

        class Sites(ast.NodeTransformer):
            def visit_Call(self, node: ast.Call) -> ast.AST:
                self.generic_visit(node)
                if id(node) not in calls:
                    return node
                original = calls[id(node)]
                if callee_root(original.func) is None:  # `Trainer(cfg).fit()`: see `method_of_temporary`
                    assert isinstance(original.func, ast.Attribute)
                    info = rewriter._new("call", original, method=original.func.attr)
                    reenter = _rt_call("reenter_method", _const(info.id), _const(info.method))
                else:  # a runner (`fire.Fire(main)`) is called again with its own arguments
                    runs = runner_argument(original, rewriter.unstable)
                    info = rewriter._new("call", original, callee=ast.unparse(original.func), runs=runs or "",
                                         bare=not original.args and not original.keywords)
                    reenter = _rt_call("reenter", _const(info.id), copy.deepcopy(original.func),
                                       *(copy.deepcopy(original.args) if runs else []))
                    reenter.keywords = copy.deepcopy(original.keywords) if runs else []
                span = (original.lineno, original.end_lineno, original.col_offset, original.end_col_offset)
                rewriter.call_spans.setdefault(rewriter.func, {})[span] = info.id
                ids.append(info.id)
                new = ast.IfExp(
                    test=ast.BoolOp(op=ast.And(), values=[_restoring(), _rt_call("go", _const(info.id))]),
                    body=reenter,
                    orelse=node)
                _fill_locations(new, original)
                # `__sg_rt__.reenter` on the call's first line: for a call spanning lines, Python
                # would otherwise move the method call's start to the attribute's last line, and
                # the re-entered frame would no longer be found at its call site (`frames`)
                for part in (new.body.func, new.body.func.value):
                    part.end_lineno, part.end_col_offset = original.lineno, original.col_offset
                return new

        new_stmt = Sites().visit(s)
        ids.sort()
        test = _rt_call("go", _const(ids[0])) if len(ids) == 1 else \
            _rt_call("go_any", ast.Tuple(elts=[_const(i) for i in ids], ctx=ast.Load()))
        return test, [new_stmt]

    # which statements hold a safe point -----------------------------------
    def tracked(self, s: ast.stmt) -> bool:
        key = id(s)
        if key not in self._tracked:
            if isinstance(s, (ast.For, ast.While)):
                result = True
            elif isinstance(s, ast.If):
                result = self.any_tracked(s.body) or self.any_tracked(s.orelse)
            elif isinstance(s, (ast.With, ast.Try)):
                result = self.any_tracked(s.body)
            else:
                result = bool(self.calls(s))
            self._tracked[key] = result
        return self._tracked[key]

    def any_tracked(self, stmts: list[ast.stmt]) -> bool:
        return any(self.tracked(s) for s in stmts)

    # blocks ----------------------------------------------------------------
    def block(self, stmts: list[ast.stmt], top_base: Optional[int] = None) -> list[ast.stmt]:
        """Rewrite a statement list; ``top_base`` set means this is the outermost block."""
        out: list[ast.stmt] = []
        plain: list[ast.stmt] = []

        def flush() -> None:
            if plain:
                guard = ast.If(test=ast.UnaryOp(op=ast.Not(), operand=_restoring()), body=list(plain), orelse=[])
                _fill_locations(guard, plain[0])
                out.append(guard)
                plain.clear()

        for i, s in enumerate(stmts):
            if top_base is not None:
                self.top_index = top_base + i
                if i > 0:
                    flush()
                    out.append(self._boundary(s))
            if self.tracked(s):
                flush()
                if isinstance(s, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
                    nid, new = self._transform(s)
                    test: ast.expr = _rt_call("go", _const(nid))
                else:
                    test, new = self._call_statement(s)
                guard = ast.If(
                    test=ast.BoolOp(op=ast.Or(), values=[
                        ast.UnaryOp(op=ast.Not(), operand=_restoring()), test]),
                    body=new, orelse=[])
                _fill_locations(guard, s)
                out.append(guard)
            else:
                plain.append(s)
        flush()
        return out or [ast.Pass()]

    def _boundary(self, s: ast.stmt) -> ast.stmt:
        info = self._new("boundary", s)
        node = ast.If(
            test=ast.BoolOp(op=ast.Or(), values=[
                ast.UnaryOp(op=ast.Not(), operand=_restoring()), _rt_call("go", _const(info.id))]),
            body=[ast.Expr(value=_rt_call("boundary", _const(info.id)))], orelse=[])
        _fill_locations(node, s)
        return node

    def _transform(self, s: ast.stmt) -> tuple[int, list[ast.stmt]]:
        if isinstance(s, ast.For):
            nid, new = self._for(s)
        elif isinstance(s, ast.While):
            nid, new = self._while(s)
        elif isinstance(s, ast.If):
            nid, new = self._if(s)
        elif isinstance(s, ast.With):
            nid, new = self._with(s)
        else:
            assert isinstance(s, ast.Try)
            nid, new = self._try(s)
        for n in new:
            _fill_locations(n, s)
        return nid, new

    # loops -----------------------------------------------------------------
    def _for(self, s: ast.For) -> tuple[int, list[ast.stmt]]:
        info = self._new("for", s)
        conflicts = bound_names(s.target) | bound_names(s.body) | self.unstable
        makers: list[ast.expr] = []
        leaves: list[Optional[LeafInfo]] = []
        src = self._src(s.iter, makers, leaves, conflicts)
        info.leaves = tuple(leaf for leaf in leaves if leaf is not None)
        call = _rt_call("enter_for", _const(info.id),
                        ast.IfExp(test=_restoring(), body=_const(None), orelse=src),
                        ast.Tuple(elts=makers, ctx=ast.Load()))
        body = self._retarget(s.target) + self.block(s.body)
        loop = ast.For(target=s.target, iter=call, body=body, orelse=s.orelse, type_comment=None)
        return info.id, [_try_finally([loop], [_pop(info.id)])]

    @staticmethod
    def _retarget(target: ast.expr) -> list[ast.stmt]:
        """``if R: x = __sg_rt.saved("x", x)`` for each name the loop target binds.

        A restore that resumes *inside* this loop's body re-enters the ``for`` statement, which
        assigns the current item to the target again; the body may have rebound those names
        since, so their checkpointed values are put back.  (Attribute or subscript targets are
        re-assigned the item itself.)
        """
        names = sorted(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if not names:
            return []
        assigns: list[ast.stmt] = [
            ast.Assign(targets=[_name(n, store=True)], value=_rt_call("saved", _const(n), _name(n)))
            for n in names]
        return [ast.If(test=_restoring(), body=assigns, orelse=[])]

    def _src(self, e: ast.expr, makers: list[ast.expr], leaves: list[Optional[LeafInfo]],
             conflicts: set[str]) -> ast.expr:
        """Describe iterable ``e`` as a tree of `leaf`/`node` calls plus one maker per entry."""
        idx = len(makers)
        makers.append(_const(None))
        leaves.append(None)
        rebound_by_with = isinstance(e, ast.Name) and any(e.id in names for names in self._with_names)
        if not isinstance(e, (ast.Call, ast.GeneratorExp)) and not rebound_by_with:
            why = "re-evaluating it would give back the same, already advanced, iterator"
        elif has_dynamic_parts(e):
            why = "it contains :=, yield or await"
        else:
            clash = sorted(loaded_names(e) & conflicts)
            why = f"the loop can rebind {', '.join(clash)}, which it reads" if clash else ""
        if not why:
            makers[idx] = ast.Lambda(
                args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                                   kwarg=None, defaults=[]),
                body=copy.deepcopy(e))
        leaves[idx] = LeafInfo(ast.unparse(e), not why, why)
        special = self._special(e)
        if special is not None:
            assert isinstance(e, ast.Call) and isinstance(e.func, ast.Name)
            children_exprs, kw = special
            children = [self._src(c, makers, leaves, conflicts) for c in children_exprs]
            kw_dict = ast.Dict(keys=[_const(k) for k in kw], values=list(kw.values()))
            return _rt_call("node", _const(idx), e.func, ast.Tuple(elts=children, ctx=ast.Load()), kw_dict)
        return _rt_call("leaf", _const(idx), e)

    @staticmethod
    def _special(e: ast.expr) -> Optional[tuple[list[ast.expr], dict[str, ast.expr]]]:
        """``enumerate(x[, start])``, ``zip(a, b, ...[, strict=])``, ``iter(x)``: children + keywords."""
        if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in _SPECIAL):
            return None
        if any(isinstance(a, ast.Starred) for a in e.args) or any(k.arg is None for k in e.keywords):
            return None
        kw = {k.arg: k.value for k in e.keywords if k.arg is not None}
        name = e.func.id
        if name == "iter":
            return (list(e.args), {}) if len(e.args) == 1 and not kw else None
        if name == "enumerate":
            if len(e.args) == 2 and not kw:
                return [e.args[0]], {"start": e.args[1]}
            if len(e.args) == 1 and set(kw) <= {"start"}:
                return [e.args[0]], kw
            return None
        if set(kw) <= {"strict"} and e.args:
            return list(e.args), kw
        return None

    def _while(self, s: ast.While) -> tuple[int, list[ast.stmt]]:
        info = self._new("while", s)
        frame = f"{PREFIX}f{info.id}"
        assign = ast.Assign(targets=[_name(frame, store=True)], value=_rt_call("enter_while", _const(info.id)))
        tick = ast.Call(func=ast.Attribute(value=_name(frame), attr="tick", ctx=ast.Load()), args=[], keywords=[])
        loop = ast.While(test=ast.BoolOp(op=ast.Or(), values=[tick, s.test]), body=self.block(s.body),
                         orelse=s.orelse)
        return info.id, [assign, _try_finally([loop], [_pop(info.id)])]

    # branches and blocks ---------------------------------------------------
    def _if(self, s: ast.If) -> tuple[int, list[ast.stmt]]:
        info = self._new("if", s)
        cond = ast.IfExp(test=_restoring(), body=_const(None),
                         orelse=ast.IfExp(test=s.test, body=_const(True), orelse=_const(False)))
        body = [_try_finally(self.block(s.body), [_pop(info.id)])]
        orelse = [_try_finally(self.block(s.orelse) if s.orelse else [ast.Pass()], [_pop(info.id)])]
        return info.id, [ast.If(test=_rt_call("enter_if", _const(info.id), cond), body=body, orelse=orelse)]

    def _with(self, s: ast.With) -> tuple[int, list[ast.stmt]]:
        targets = bound_names([i.optional_vars for i in s.items if i.optional_vars is not None])
        info = self._new("with", s, with_targets=tuple(sorted(targets)))
        items = [ast.withitem(context_expr=_rt_call("enter_with", _const(info.id)), optional_vars=None)]
        for item in s.items:
            items.append(ast.withitem(context_expr=_rt_call("with_ctx", _const(info.id), item.context_expr),
                                      optional_vars=item.optional_vars))
        # a loop over an `as` target (`with open(p) as f: for line in f:`) may re-create its
        # iterator by reading the name again: the restore re-enters this header first
        self._with_names.append(targets)
        try:
            body = self.block(s.body)
        finally:
            self._with_names.pop()
        return info.id, [ast.With(items=items, body=body, type_comment=None)]

    def _try(self, s: ast.Try) -> tuple[int, list[ast.stmt]]:
        info = self._new("try", s)
        body: list[ast.stmt] = [ast.With(
            items=[ast.withitem(context_expr=_rt_call("enter_try", _const(info.id)), optional_vars=None)],
            body=self.block(s.body), type_comment=None)]
        handlers = list(s.handlers)
        if handlers:
            handlers.insert(0, ast.ExceptHandler(type=_rt_attr("Preempted"), name=None,
                                                 body=[ast.Raise(exc=None, cause=None)]))
        final: list[ast.stmt] = []
        if s.finalbody:
            final = [ast.If(test=ast.UnaryOp(op=ast.Not(), operand=_rt_attr("preempting")),
                            body=s.finalbody, orelse=[])]
        return info.id, [ast.Try(body=body, handlers=handlers, orelse=s.orelse, finalbody=final)]


# --------------------------------------------------------------------------- next() calls
def _binds_next(tree: ast.AST) -> bool:
    """Whether the code gives the name ``next`` a meaning of its own (then its calls stay as they are)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "next" and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "next":
            return True
        if isinstance(node, ast.arg) and node.arg == "next":
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name) == "next":
            return True
    return False


class _CountNext(ast.NodeTransformer):
    """``next(it[, default])`` -> ``__sg_rt.next_item(it[, default])`` (manual_next.py)."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "next" and not node.keywords \
                and 1 <= len(node.args) <= 2 and not any(isinstance(a, ast.Starred) for a in node.args):
            return ast.copy_location(_rt_call("next_item", *node.args), node)
        return node


def _count_next_calls(tree: ast.AST) -> None:
    if not _binds_next(tree):
        _CountNext().visit(tree)


# --------------------------------------------------------------------------- entry points
def rewrite_module(source: str, filename: str) -> Rewritten:
    """Parse and rewrite a cell/script; the last expression statement feeds ``set_result``."""
    tree = ast.parse(source, filename=filename, mode="exec")
    spawned.rewrite(tree, imported_names(tree))  # mp.spawn(main_worker, ...): the rank is one of them
    statements = _statement_infos(tree.body)
    unstable = declared_global(tree)
    body = list(tree.body)
    head = 0
    while head < len(body) and (
            (head == 0 and _is_docstring(body[0]) and len(body) > 1)  # a lone string is the cell's value
            or (isinstance(body[head], ast.ImportFrom) and body[head].module == "__future__")):
        head += 1
    returns_last = bool(body) and len(body) > head and isinstance(body[-1], ast.Expr)
    if returns_last:
        last = body[-1]
        assert isinstance(last, ast.Expr)
        body[-1] = ast.copy_location(ast.Expr(value=_rt_call("set_result", last.value)), last)
    rw = _Rewriter(unstable, library_roots(tree) | {RT})
    rw.functions(tree)
    new_body = body[:head] + rw.block(body[head:], top_base=head)
    new_tree = ast.Module(body=new_body, type_ignores=[])
    _count_next_calls(new_tree)
    ast.fix_missing_locations(new_tree)
    return Rewritten(new_tree, rw.nodes, statements, frozenset(unstable), bool(rw.nodes), returns_last,
                     defs=rw.defs, unchanged_defs=rw.unchanged_defs, call_spans=rw.call_spans)


def rewrite_library(source: str, filename: str, base: int, count_next: bool = False,
                    module: str = "", rewritten: frozenset[str] = frozenset()) -> Rewritten:
    """Rewrite the functions of a library module (`libraries`), not its top level: the module
    body runs as it is when imported; every function holding a loop or a call site gets safe
    points like a function of the program.  Node and function ids start above ``base``.
    ``count_next``: the module is the job's own (a helper beside the script), whose ``next()``
    calls are the program's (manual_next.py: ``skip_header(f)`` before the loop reads ``f``).
    ``module`` is its name and ``rewritten`` the other modules rewritten so: a call through a name
    bound to one of those (``call._call_and_handle_interrupt(...)`` after ``from
    lightning.pytorch.trainer import call``) is a call site, not a call into the library."""
    tree = ast.parse(source, filename=filename, mode="exec")
    roots = library_roots(tree) - names_of_modules(tree, module, rewritten)
    rw = _Rewriter(declared_global(tree), roots | {RT}, base=base)
    rw.functions(tree)
    if count_next:
        _count_next_calls(tree)
    ast.fix_missing_locations(tree)
    return Rewritten(tree, rw.nodes, [], frozenset(rw.unstable), bool(rw.nodes), defs=rw.defs,
                     unchanged_defs=rw.unchanged_defs, call_spans=rw.call_spans)


def rewrite_function(fdef: ast.FunctionDef, local_names: list[str], params: list[str],
                     freevars: list[str]) -> Rewritten:
    """Rewrite one function definition into ``def __sg_factory(__sg_rt, *freevars): def f...``.

    Decorators, annotations and default expressions are dropped from the copy (the caller
    restores ``__defaults__``/``__kwdefaults__``/``__annotations__`` from the original), because
    evaluating them again could fail or differ.  A prologue loads the saved locals on restore.
    """
    statements = _statement_infos(fdef.body)
    unstable = declared_global(fdef)
    fdef = copy.deepcopy(fdef)
    fdef.decorator_list = []
    fdef.returns = None
    args = fdef.args
    for a in args.posonlyargs + args.args + args.kwonlyargs + [x for x in (args.vararg, args.kwarg) if x]:
        a.annotation = None
    args.defaults = [_const(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else _const(None) for d in args.kw_defaults]
    body = list(fdef.body)
    head = 1 if body and _is_docstring(body[0]) else 0
    rw = _Rewriter(unstable)
    rest = rw.block(body[head:], top_base=head)
    first = body[head] if len(body) > head else body[0]
    prologue: list[ast.stmt] = [ast.Expr(value=_rt_call("enter_function"))]
    if "__class__" in freevars:
        prologue.append(ast.Expr(value=_name("__class__")))  # keeps zero-argument super() working
    loads: list[ast.stmt] = [ast.Assign(targets=[_name(f"{PREFIX}L", store=True)],
                                        value=_rt_call("restored_locals"))]
    for name in local_names:
        saved = ast.Subscript(value=_name(f"{PREFIX}L"), slice=_const(name), ctx=ast.Load())
        test = ast.Compare(left=_const(name), ops=[ast.In()], comparators=[_name(f"{PREFIX}L")])
        orelse: list[ast.stmt] = [ast.Delete(targets=[_name(name, store=False)])] if name in params else []
        if orelse:
            orelse[0].targets[0].ctx = ast.Del()  # type: ignore[attr-defined]
        loads.append(ast.If(test=test, body=[ast.Assign(targets=[_name(name, store=True)], value=saved)],
                            orelse=orelse))
    prologue.append(ast.If(test=_restoring(), body=loads, orelse=[]))
    for p in prologue:
        _fill_locations(p, first)
    fdef.body = body[:head] + prologue + rest
    factory_args = [ast.arg(arg=RT)] + [ast.arg(arg=v) for v in freevars]
    factory = ast.FunctionDef(
        name=f"{PREFIX}factory",
        args=ast.arguments(posonlyargs=[], args=factory_args, vararg=None, kwonlyargs=[], kw_defaults=[],
                           kwarg=None, defaults=[]),
        body=[fdef, ast.Return(value=_name(fdef.name))], decorator_list=[], returns=None, type_comment=None)
    _fill_locations(factory, fdef)
    tree = ast.Module(body=[factory], type_ignores=[])
    _count_next_calls(tree)
    ast.fix_missing_locations(tree)
    return Rewritten(tree, rw.nodes, statements, frozenset(unstable), bool(rw.nodes),
                     local_names=tuple(local_names))
