"""The code's shape, checked: the SDK is a client (it imports nothing of the service), packages
do not import each other back, modules do not import each other in a circle, and no private
name is imported across modules. Imports inside functions and under TYPE_CHECKING count."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "singularity_sdk", "jupyter_ext")
#: private names of other libraries that the proxy must reach (no public equivalent exists)
FOREIGN_PRIVATE_OK = {"torch", "IPython"}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _ours(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path):
    """(target module of ours or "", imported name or "", the statement's module text) per import."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _ours(alias.name), "", alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield _ours(full if full in MODULES else base), alias.name, base


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m, p) if t and t != m} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


#: the device proxy's layers, lowest first: each imports only the layers below it (the launchers,
#: modules of ``backend.proxy`` itself, sit on top)
PROXY_LAYERS = ("backend.proxy.checkpoint", "backend.proxy.engine", "backend.proxy.distributed")


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["backend", "proxy"] and len(parts) > 3:
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if parts[0] == "backend" and len(parts) > 1 else parts[0]


def test_the_sdk_imports_nothing_of_the_service_or_the_notebook_extension():
    bad = [(m, t) for m, p in MODULES.items() if m.startswith("singularity_sdk")
           for t, _, _ in _imports(m, p) if t.startswith(("backend", "jupyter_ext"))]
    assert not bad, bad


def test_no_package_imports_one_that_imports_it_back():
    graph: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        for t in targets:
            if _package(m) != _package(t):
                graph.setdefault(_package(m), set()).add(_package(t))
    assert _cycles(graph) == []


def test_the_proxy_layers_import_only_the_layers_below_them():
    bad = []
    for m, targets in _graph().items():
        if _package(m) in PROXY_LAYERS:
            below = PROXY_LAYERS[:PROXY_LAYERS.index(_package(m)) + 1]
            bad += [(m, t) for t in targets if t.startswith("backend.proxy") and _package(t) not in below]
    assert not bad, bad


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_private_name_is_imported_across_modules():
    bad = []
    for m, p in MODULES.items():
        for target, name, base in _imports(m, p):
            if name.startswith("_") and not name.startswith("__"):
                if target or base.split(".")[0] not in FOREIGN_PRIVATE_OK:
                    bad.append(f"{m}: from {base} import {name}")
    assert not bad, bad


def test_no_class_is_over_400_lines():
    """A class that long owns more than one concept (the proxy's process group was split for this)."""
    sizes = {}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{m}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not {k: v for k, v in sizes.items() if v > 400}
