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

Patches are made in the shapes research code makes them, and each is found: ``setattr(F,
"gelu", my_gelu)`` with a constant name counts as an assignment; the job's own helper modules
are scanned as the script is (DeiT's and DETR's ``utils.setup_for_distributed`` replaces
``builtins.print`` from a function of ``utils.py``); a name that is no global (``import
builtins as __builtin__`` inside that function, ``mod = importlib.import_module("...")``) is looked
up through the imports the file makes; and ``for name in ("relu", "gelu"): setattr(F, name, ...)``
counts for each name of the literal.
"""
from __future__ import annotations

import ast
import builtins
import sys
import types
import warnings
from typing import Any, Callable, Optional

Candidate = tuple[tuple[str, ...], str]  # (the dotted name's parts, the attribute)
#: the builtins as Python made them, before the program ran (the engine is imported first)
PRISTINE_BUILTINS = dict(vars(builtins))
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
    """``(name parts, attribute)`` of every assignment to ``a.b.attr`` in ``tree`` (any depth),
    and of every ``setattr(a.b, "attr", value)`` with a constant name."""
    found: set[Candidate] = set()
    looped = _looped_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                attrs = [name.value]
            elif isinstance(name, ast.Name):  # for name in ("relu", "gelu"): setattr(F, name, ...)
                attrs = looped.get(name.id, [])
            else:
                attrs = []
            targets = [ast.Attribute(value=node.args[0], attr=a, ctx=ast.Store()) for a in attrs]
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


def _looped_names(tree: ast.AST) -> dict[str, list[str]]:
    """Each name a ``for`` statement binds to the strings of a literal tuple or list."""
    names: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List)):
            strings = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            names.setdefault(node.target.id, []).extend(strings)
    return names


def _module_named_by(value: ast.expr) -> Optional[str]:
    """The module ``importlib.import_module("a.b")``, ``__import__("a")`` or ``sys.modules["a.b"]``
    with a constant name evaluates to; None for anything else."""
    if isinstance(value, ast.Subscript) and _dotted(value.value) == ("sys", "modules") \
            and isinstance(value.slice, ast.Constant) and isinstance(value.slice.value, str):
        return value.slice.value
    if isinstance(value, ast.Call) and len(value.args) == 1 and isinstance(value.args[0], ast.Constant) \
            and isinstance(value.args[0].value, str):
        func = _dotted(value.func)
        if func in (("importlib", "import_module"), ("import_module",)):
            return value.args[0].value
        if func == ("__import__",):
            return value.args[0].value.partition(".")[0]  # __import__("a.b") returns a
    return None


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Each name an import statement anywhere in ``tree`` binds -> the dotted path it imports
    (``import builtins as __builtin__`` -> ``builtins``; ``from torch.nn import functional as F``
    -> ``torch.nn.functional``): how a patch made inside a function names its module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                    alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            module = _module_named_by(node.value)  # mod = importlib.import_module("torch.nn.functional")
            if module is not None:
                names[node.targets[0].id] = module
    return names


def _imported(path: str) -> Any:
    """What the dotted ``path`` names among the modules already imported (nothing is imported here)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        if obj is not None:
            for part in parts[i:]:
                obj = getattr(obj, part, None)
            return obj
    return None


#: module name -> (its module object, its patches, its imported names), for the job's helper modules
_scanned: dict[str, tuple[Any, tuple[Candidate, ...], dict[str, str]]] = {}


def module_patches(modules: dict[str, types.ModuleType]) -> list[tuple[dict, tuple[Candidate, ...], dict[str, str]]]:
    """For each of the job's helper modules that patches something: its globals, the patches its
    source makes and the names its imports bind (each source parsed once per module object)."""
    out = []
    for name, module in modules.items():
        known = _scanned.get(name)
        if known is None or known[0] is not module:
            found: tuple[Candidate, ...] = ()
            imports: dict[str, str] = {}
            try:
                with open(module.__file__, "rb") as f:  # type: ignore[arg-type]
                    tree = ast.parse(f.read())
                found, imports = candidates(tree), imported_names(tree)
            except (OSError, SyntaxError, ValueError, TypeError):
                pass
            known = _scanned[name] = (module, found, imports)
        if known[1]:
            out.append((vars(module), known[1], known[2]))
    return out


def _owner(program_globals: dict, parts: tuple[str, ...], imports: Optional[dict[str, str]] = None) -> Any:
    """The module or class ``parts`` names in the program's globals (or through the file's
    imports), else None (a local variable, an instance: its attributes are saved with it)."""
    obj = program_globals.get(parts[0])
    if obj is None and imports and parts[0] in imports:
        obj = _imported(imports[parts[0]])
    for part in parts[1:]:
        if not isinstance(obj, (types.ModuleType, type)):
            return None
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - a lazy module attribute that fails: nothing to keep
            return None
    return obj if isinstance(obj, (types.ModuleType, type)) and obj is not sys else None


def capture(program_globals: dict, found: tuple[Candidate, ...],
            probe: Callable[[Any], Optional[str]], imports: Optional[dict[str, str]] = None,
            helpers: Optional[dict[str, types.ModuleType]] = None) -> list[tuple[Any, str, Any]]:
    """``[(module or class, attribute, value)]`` to set again on restore: the program's patches
    (``found``, its names resolved in ``program_globals`` or ``imports``), then those of the
    job's ``helpers`` modules."""
    out = []
    seen: set[tuple[int, str]] = set()
    sources = [(program_globals, found, imports)] + module_patches(helpers or {})
    for scope, patches, names in sources:
        for parts, attr in patches:
            owner = _owner(scope, parts, names)
            if owner is None or (id(owner), attr) in seen:
                continue
            seen.add((id(owner), attr))
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


def reduce_replaced_builtin(obj: Any) -> Any:
    """A builtin function (``print``) that the program has since replaced in ``builtins``
    (``builtins.print = print_on_rank0``, whose closure keeps the original): pickle names a
    builtin by where it lives, finds the replacement there and refuses. Saved as the original,
    which the load takes from the builtins as Python made them (a helper module imported again on
    restore may have replaced it by then). NotImplemented for anything else."""
    name = getattr(obj, "__name__", None)
    if getattr(obj, "__self__", None) is builtins and isinstance(name, str) \
            and PRISTINE_BUILTINS.get(name) is obj and getattr(builtins, name, None) is not obj:
        return _original_builtin, (name,)
    return NotImplemented


def _original_builtin(name: str) -> Any:
    return PRISTINE_BUILTINS[name]


def apply(saved: Optional[list]) -> None:
    for owner, attr, value in saved or ():
        try:
            if getattr(owner, attr, None) is not value:
                setattr(owner, attr, value)
        except (AttributeError, TypeError) as exc:
            warnings.warn(f"{getattr(owner, '__name__', owner)}.{attr} could not be set again ({exc}); "
                          f"results after the restore may differ", RuntimeWarning, stacklevel=2)
