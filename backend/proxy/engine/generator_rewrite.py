"""The AST rewrite that lets a suspended generator of the program be saved and resumed.

``def forever(loader): while True: for batch in loader: yield batch`` is how many training
scripts cycle a DataLoader, and where a suspended generator stopped cannot be pickled. A
generator function the program defines at module level (or as a method of a module-level class)
is rewritten so that its frame can be rebuilt (`resumable_generators` keeps the state):

* its first statement makes its state ``__sg_g__`` (``begin()``: fresh, or the saved one when a
  restore made this generator) and, when restoring, loads the saved locals;
* every ``yield X`` statement records which one it is (``__sg_at__``) before yielding;
  restoring, the recorded one ends the restore (execution goes on just after it) and the others
  are skipped;
* ``yield from E`` is ``for v in E: yield v`` (the same items, one by one);
* a ``for`` loop holding a yield keeps its live iterator in the state (saved with the
  generator); restoring, the loop's first item is its target's restored values, then the saved
  iterator's items;
* a ``while`` loop holding a yield re-enters its body without testing the condition when
  restoring; an ``if`` holding one takes the branch that holds the recorded yield;
* any other statement is skipped while restoring: it ran before the checkpoint, and what it did
  is in the restored locals and objects;
* a ``with`` holding a yield enters its manager through the state, which keeps it while the body
  runs (saved with the generator: a file opened by ``open()`` is re-opened where it stood;
  `resumable_generators.reduce` refuses any other manager, whose ``__enter__`` may have set
  state that a restore would not set again); restoring, it is not entered again.

Only generators of this shape are rewritten (`why_not`): every yield a statement of its own,
inside nothing but ``for``, ``while``, ``if``, ``with`` and the body of a ``try`` (whose handlers
and ``finally`` then run as they would have: the restore arrives inside it), and no decorator
but ``@staticmethod``, ``@classmethod`` and ``@contextmanager``. Others run unchanged, and a checkpoint of one
suspended fails naming it, as before.
"""
from __future__ import annotations

import ast
from typing import Optional

from .analysis import closures_sharing, function_locals, own_scope

#: the rewrite's own names end in ``__``, so that in a method they are not mangled
STATE = "__sg_g__"
LOCALS = "__sg_L__"
RESTORING = "__sg_r__"  # a local copy of ``STATE.restoring``: tested at every statement
LOOP_PREFIX = "__sg_l"  # + the loop's number + "__": the local holding a loop's iterator
AT = "__sg_at__"  # the yield it is suspended at (0: none yet); a local, as cheap to set as can be
MODULE = "backend.proxy.engine.resumable_generators"
_COMPOUND = (ast.For, ast.While, ast.If, ast.With, ast.Try)
#: decorators a rewritten generator may have: `@contextmanager` makes a manager whose generator is
#: saved where it waits (held_managers.py: a with statement around the loop holds it across stops)
_DECORATORS = ("staticmethod", "classmethod", "contextmanager", "contextlib.contextmanager")


def _yields(node: ast.AST) -> list[ast.AST]:
    """The yields of ``node``'s own scope (a function's body, or a statement of it)."""
    body = node if isinstance(node, ast.FunctionDef) else ast.Module(body=[node], type_ignores=[])
    return [n for n in own_scope(body) if isinstance(n, (ast.Yield, ast.YieldFrom))]


def _holds_yield(stmt: ast.stmt) -> bool:
    return bool(_yields(stmt))


def why_not(fdef: ast.FunctionDef) -> str:
    """Why a generator function cannot be rewritten (it runs unchanged), or ''."""
    if any(ast.unparse(d) not in _DECORATORS for d in fdef.decorator_list):
        return "a decorated generator"
    statements = {id(s.value) for s in ast.walk(fdef) if isinstance(s, ast.Expr)}
    for y in _yields(fdef):
        if id(y) not in statements:
            return "a generator that uses the value of a yield (send)"
    for n in own_scope(fdef):
        if isinstance(n, (ast.Nonlocal, ast.Global, ast.Await)):
            return "a generator with nonlocal, global or await"

    shared = closures_sharing(fdef)
    if shared:
        return shared

    def check(body: list[ast.stmt]) -> str:
        for stmt in body:
            if not _holds_yield(stmt) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Yield, ast.YieldFrom))):
                continue
            if not isinstance(stmt, _COMPOUND):
                return f"a yield inside a {type(stmt).__name__.lower()} statement"
            if isinstance(stmt, ast.With) and any(i.optional_vars is not None and not isinstance(i.optional_vars, ast.Name)
                                                  for i in stmt.items):
                return "a with target that is not a name"
            if isinstance(stmt, (ast.For, ast.While)) and any(_holds_yield(s) for s in stmt.orelse):
                return "a yield in a loop's else block"
            if isinstance(stmt, ast.For) and not isinstance(stmt.target, (ast.Name, ast.Tuple, ast.List)):
                return "a loop target that is not a name"
            if isinstance(stmt, ast.Try) and any(_holds_yield(s) for s in [*stmt.orelse, *stmt.finalbody,
                                                                         *(x for h in stmt.handlers for x in h.body)]):
                return "a yield in a try statement's except, else or finally block"
            found = check(stmt.body) or check(getattr(stmt, "orelse", []))
            if found:
                return found
        return ""

    return check(fdef.body)


class _GeneratorRewriter:
    """Rewrites one generator function's body in place (see the module's docstring)."""

    def __init__(self, fdef: ast.FunctionDef, class_name: str) -> None:
        self.fdef = fdef
        self.class_name = class_name
        self.next_id = 0
        #: yield id -> the compound statements around it, outermost first, each with the branch
        #: (True: its body, False: its else) that holds the yield
        self.paths: dict[int, tuple[tuple[int, bool], ...]] = {}
        self.loop_vars: list[str] = []

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def rewrite(self) -> None:
        body = list(self.fdef.body)
        head = 1 if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str) else 0
        first = body[head]
        names = sorted(set(function_locals(self.fdef)) - {STATE})
        rest = self.block(body[head:], ())
        paths = {k: [list(p) for p in v] for k, v in self.paths.items()}
        prologue = _scaffold(
            f"{STATE} = __import__({MODULE!r}, fromlist=['begin']).begin({paths!r})\n"
            f"{RESTORING} = {STATE}.restoring\n"
            f"{AT} = {STATE}.at\n"
            f"if {RESTORING}:\n"
            f"    {LOCALS} = {STATE}.locals\n"
            + "".join(f"    if {self.mangled(n)!r} in {LOCALS}:\n        {n} = {LOCALS}[{self.mangled(n)!r}]\n"
                      for n in names + self.loop_vars)
            + f"    del {LOCALS}\n", first)
        self.fdef.body = body[:head] + prologue + rest

    def mangled(self, name: str) -> str:
        """``name`` as the frame's locals hold it: ``__x`` in a method of ``C`` is ``_C__x``."""
        owner = self.class_name.lstrip("_")
        if owner and name.startswith("__") and not name.endswith("__"):
            return f"_{owner}{name}"
        return name

    def block(self, body: list[ast.stmt], path: tuple) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            out.extend(self.statement(stmt, path))
        return out

    def statement(self, stmt: ast.stmt, path: tuple) -> list[ast.stmt]:
        if not _holds_yield(stmt):
            guard = _scaffold(f"if not {RESTORING}:\n    pass", stmt)
            guard[0].body = [stmt]  # type: ignore[attr-defined]
            return guard
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.YieldFrom):
            var = f"__sg_yf{self._id()}__"
            self.loop_vars.append(var)
            loop = _scaffold(f"for {var} in __sg_iterable:\n    yield {var}", stmt)[0]
            loop.iter = stmt.value.value  # type: ignore[attr-defined]
            return self.statement(loop, path)
        if isinstance(stmt, ast.Expr):  # a yield
            yid = self._id()
            self.paths[yid] = path
            code = _scaffold(f"if {RESTORING}:\n    {RESTORING} = {STATE}.arrive({yid})\n"
                             f"else:\n    {AT} = {yid}\n    pass\n", stmt)
            code[0].orelse[1] = stmt  # type: ignore[attr-defined]
            return code
        nid = self._id()
        guard = _scaffold(f"if not {RESTORING} or {STATE}.on_path({nid}):\n    pass", stmt)
        if isinstance(stmt, ast.If):
            test = _scaffold(f"{STATE}.branch({nid}) if {RESTORING} else None", stmt.test, expr=True)
            test.orelse, stmt.test = stmt.test, test  # type: ignore[attr-defined]
            stmt.body = self.block(stmt.body, path + ((nid, True),)) or _scaffold("pass", stmt)
            stmt.orelse = self.block(stmt.orelse, path + ((nid, False),))
            guard[0].body = [stmt]  # type: ignore[attr-defined]
            return guard
        if isinstance(stmt, ast.With):
            if len(stmt.items) > 1:  # `with a as x, b as y:` is `with a as x:` around `with b as y:`
                inner = ast.With(items=stmt.items[1:], body=stmt.body, type_comment=None)
                ast.copy_location(inner, stmt)
                stmt.items, stmt.body = stmt.items[:1], [inner]
            [item] = stmt.items
            target = "" if item.optional_vars is None else f"{ast.unparse(item.optional_vars)} = "
            code = _scaffold(f"if not {RESTORING}:\n    {target}{STATE}.enter_with({nid}, None)\n"
                             f"try:\n    pass\nexcept BaseException:\n"
                             f"    if not {STATE}.exit_with({nid}, True):\n        raise\n"
                             f"finally:\n    {STATE}.exit_with({nid}, False)\n", stmt)
            code[0].body[0].value.args[1] = item.context_expr  # type: ignore[attr-defined]
            code[1].body = self.block(stmt.body, path + ((nid, True),)) or _scaffold("pass", stmt)  # type: ignore[attr-defined]
            guard[0].body = code  # type: ignore[attr-defined]
            return guard
        if isinstance(stmt, ast.Try):  # restoring, the body is entered; the yield is in it (`why_not`)
            stmt.body = self.block(stmt.body, path + ((nid, True),)) or _scaffold("pass", stmt)
            guard[0].body = [stmt]  # type: ignore[attr-defined]
            return guard
        if isinstance(stmt, ast.While):
            test = _scaffold(f"{RESTORING} or None", stmt.test, expr=True)
            test.values[1], stmt.test = stmt.test, test  # type: ignore[attr-defined]
            stmt.body = self.block(stmt.body, path + ((nid, True),)) or _scaffold("pass", stmt)
            guard[0].body = [stmt]  # type: ignore[attr-defined]
            return guard
        assert isinstance(stmt, ast.For)
        var = f"{LOOP_PREFIX}{nid}__"
        self.loop_vars.append(var)
        # restoring, the loop's first item is its target's values as restored (the statements
        # before the yield are skipped, so that is what the target must hold), then the iterator
        code = _scaffold(f"{var} = {STATE}.resume_for({nid}, ({ast.unparse(stmt.target)},)) if {RESTORING} "
                         f"else {STATE}.enter_for({nid}, None)\n"
                         f"try:\n    pass\nfinally:\n    {STATE}.leave({nid})\n", stmt)
        code[0].value.orelse.args[1] = stmt.iter  # type: ignore[attr-defined]
        stmt.iter = _scaffold(var, stmt.iter, expr=True)
        stmt.body = self.block(stmt.body, path + ((nid, True),)) or _scaffold("pass", stmt)
        code[1].body = [stmt]  # type: ignore[attr-defined]
        guard[0].body = code  # type: ignore[attr-defined]
        return guard


def _scaffold(src: str, at: ast.AST, expr: bool = False):  # -> list[ast.stmt] | ast.expr
    """``src`` parsed, every node of it at ``at``'s place (tracebacks point into the source)."""
    tree = ast.parse(src, mode="eval" if expr else "exec")
    for n in ast.walk(tree):
        if "lineno" in n._attributes:
            n.lineno, n.col_offset = at.lineno, at.col_offset  # type: ignore[attr-defined]
            n.end_lineno = getattr(at, "end_lineno", at.lineno)  # type: ignore[attr-defined]
            n.end_col_offset = getattr(at, "end_col_offset", at.col_offset)  # type: ignore[attr-defined]
    return tree.body


def rewrite(fdef: ast.FunctionDef, class_name: str = "") -> Optional[str]:
    """Rewrite ``fdef`` (a method of ``class_name`` when given) in place when it is a generator
    this can make resumable; else the reason it runs unchanged."""
    reason = why_not(fdef)
    if reason:
        return reason
    _GeneratorRewriter(fdef, class_name).rewrite()
    return None
