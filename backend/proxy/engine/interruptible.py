"""Whether and where a program can be interrupted, told before anyone tries.

A preempt waits for a safe point; a program whose loops all run inside functions the rewrite
does not instrument has none in its loops, and its user should learn that at start, not from a
first preemption that times out. The answer is derived from what the rewrite actually tracked
(``ResumableProgram.nodes``), so it follows the rewrite as it learns to instrument more code:
a loop is a safe point here exactly when the rewrite made it one.
"""
from __future__ import annotations

import ast
import linecache
from typing import Any, Iterator, Optional

from . import analysis, libraries

#: at most this many locations are listed in the event (the count is always given)
MAX_LISTED = 20


def _source_tree(program: Any) -> Optional[ast.AST]:
    """The submitted code as the rewrite saw it (its lines are the tracked nodes' lines)."""
    if program.kind == "source":
        text = "".join(linecache.getlines(program.filename))
        try:
            return ast.parse(text) if text else None
        except SyntaxError:
            return None
    statements = getattr(program, "statements", None) or []
    return ast.Module(body=[s.node for s in statements], type_ignores=[])


def _loops(tree: ast.AST, reasons: dict[int, str]) -> list[tuple[int, str, Optional[str], str]]:
    """Every ``for``/``while`` of the code: (line, kind, name of the innermost enclosing def, why
    that def runs unchanged or ''); ``reasons``: the rewrite's, by the def's line."""
    out: list[tuple[int, str, Optional[str], str]] = []

    def walk(node: ast.AST, scope: Optional[str], why: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner, inner_why = scope, why
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name if scope is None else f"{scope}.{child.name}"
                inner_why = reasons.get(child.lineno) or analysis.not_rewritable(child)
            elif isinstance(child, ast.ClassDef):
                inner = child.name if scope is None else f"{scope}.{child.name}"
            elif isinstance(child, (ast.For, ast.While, ast.AsyncFor)):
                out.append((child.lineno, "while" if isinstance(child, ast.While) else "for", scope, why))
            walk(child, inner, inner_why)

    walk(tree, None, "")
    return out


def describe_missed(missed: list[dict[str, Any]]) -> str:
    """``10 (in main: async functions run unchanged), 14 (in fit)``: where loops without a safe
    point are, and why their function runs unchanged where the rewrite says so."""
    def one(m: dict[str, Any]) -> str:
        if not m["function"]:
            return str(m["line"])
        return f"{m['line']} (in {m['function']}" + (f": {m['why']})" if m.get("why") else ")")

    return ", ".join(one(m) for m in missed[:MAX_LISTED])


def _top_level_calls(tree: ast.AST, names: set[str]) -> dict[str, list[int]]:
    """Lines of the top-level statements that call one of ``names`` (``main()``)."""
    found: dict[str, list[int]] = {}
    for stmt in getattr(tree, "body", []):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                if name in names and node.lineno not in found.setdefault(name, []):
                    found[name].append(node.lineno)
    return found


def _handed(call: ast.Call) -> Iterator[ast.Name]:
    """The names a call passes, also inside literal containers (``fire.Fire({"train": train})``)."""
    todo = [*call.args, *(k.value for k in call.keywords)]
    while todo:
        arg = todo.pop(0)
        if isinstance(arg, ast.Name):
            yield arg
        elif isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
            todo += arg.elts
        elif isinstance(arg, ast.Dict):
            todo += arg.values


def _handed_to_libraries(tree: ast.AST, nodes: list) -> dict[str, str]:
    """Functions of the program that a library call receives (``threading.Thread(target=train)``,
    ``mp.spawn(fn, join=False)``, ``fire.Fire({"train": train})``) and that no call site of the
    program calls: name -> ``the call (line N)``. Their loops are tracked, but the library's frames
    stand between them and the top level, so no safe point in them is usable."""
    calls = [n for n in nodes if n.kind == "call"]
    called = {n.callee.rpartition(".")[2] for n in calls if n.callee} | {n.method for n in calls if n.method} | \
        {n.runs for n in calls if n.runs}  # `fire.Fire(main)`: a restore calls it again (`library_wrappers`)
    library = analysis.library_roots(tree)
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or analysis.callee_root(node.func) not in library:
            continue
        for arg in _handed(node):
            if arg.id not in called and arg.id not in library:
                out.setdefault(arg.id, f"{ast.unparse(node.func)}() at line {node.lineno}")
    return out


def report(program: Any) -> dict[str, Any]:
    """The ``interruptible`` event: safe-point loops, loops that are not safe points, and a message."""
    nodes = list(program.nodes.values())
    instrumented = {(n.line, n.kind) for n in nodes if n.kind in ("for", "while")}
    boundaries = sum(1 for n in nodes if n.kind == "boundary")
    tree = _source_tree(program)
    loops = _loops(tree, getattr(program, "unchanged_defs", {})) if tree is not None \
        else [(line, kind, None, "") for line, kind in sorted(instrumented)]
    scope_of = {(line, kind): scope for line, kind, scope, _ in loops}
    safe = [{"line": n.line, "kind": n.kind,
             "function": getattr(n, "function", None) or scope_of.get((n.line, n.kind))}
            for n in sorted(nodes, key=lambda n: n.line) if n.kind in ("for", "while")]
    missed = [{"line": line, "kind": kind, "function": scope, "why": why} for line, kind, scope, why in loops
              if (line, kind) not in instrumented]
    handed = _handed_to_libraries(tree, nodes) if tree is not None else {}
    for entry in [s for s in safe if (s["function"] or "").split(".")[0] in handed]:
        name = entry["function"].split(".")[0]
        safe.remove(entry)
        missed.append({**entry, "why": f"{name}() is called by {handed[name]}, a library function, which a "
                                      f"restore cannot call again; call {name}() from the program itself"})
    name = program.filename
    out: dict[str, Any] = {"interruptible": bool(safe), "safe_points": safe[:MAX_LISTED], "loops": len(safe),
                           "boundaries": boundaries, "not_safe_points": missed[:MAX_LISTED]}
    if safe:
        lines = ", ".join(str(s["line"]) for s in safe[:MAX_LISTED])
        out["message"] = (f"interruptible: a safe point at the top of each iteration of the loops at "
                          f"{name} line(s) {lines}" + (f"; {len(missed)} other loop(s) run to completion "
                                                        f"first" if missed else ""))
    elif missed:
        funcs = {m["function"].split(".")[0] for m in missed if m["function"]}
        callers = _top_level_calls(tree, funcs) if tree is not None else {}
        where = describe_missed(missed)
        called = sorted({line for lines in callers.values() for line in lines})
        out["called_from"] = {k: v for k, v in sorted(callers.items())}
        out["message"] = (f"no safe point: the loops at {name} line(s) {where} run inside functions"
                          + (f" called from line(s) {', '.join(map(str, called))}" if called else "")
                          + "; a preempt, migrate or resize waits up to its bound for a safe point, then "
                            "answers checkpoint_failed saying where the job is, and the job runs on")
    else:
        out["message"] = ("no loops: safe points only between top-level statements" if boundaries
                          else "no safe point: the job cannot be checkpointed while it runs")
    modules = libraries.modules_from_env()
    out["library_modules"] = modules
    if modules and not safe:
        out["message"] += f"; loops in the library modules {', '.join(modules)} are safe points too, once imported"
    return out
