"""``torch.multiprocessing.spawn`` in a job: each rank of the job is one of the spawned processes.

The DDP tutorial's shape, and the ImageNet example's, is a parent that spawns one process per
device, ``mp.spawn(main_worker, args=(world_size, args), nprocs=world_size)``, each of which joins
the process group as rank ``i``. A job already runs one process per rank, so such a script spawned
``W × W`` processes, which fought over the script's fixed rendezvous port and escaped the engine.

So the rewrite turns the statement into a call of the function itself (`rewrite`):
``__sg_rt__.spawn_joined(main_worker(__sg_rt__.spawned_rank(world_size), *(world_size, args)))``.
Every rank runs the script's code up to the spawn as the parent would (argparse, reading the
config), then runs ``main_worker`` as spawned process number RANK; ``nprocs`` must be the job's
number of ranks (`spawned_rank` says so otherwise). ``main_worker`` is called from a call site of
the program, so its loops are safe points like those of ``main()``. What the parent does after
the spawn returned runs on rank 0, once its own process returned (`spawn_joined`: the other
ranks end there, as spawned processes do); it does not wait for the others.
"""
from __future__ import annotations

import ast
import os
from typing import Any, Optional

#: what a spawn call's callee must resolve to (through the script's imports)
_SPAWNS = ("torch.multiprocessing.spawn", "torch.multiprocessing.spawn.spawn",
           "torch.multiprocessing.start_processes", "torch.multiprocessing.spawn.start_processes")
_PARAMS = ("fn", "args", "nprocs", "join", "daemon", "start_method")


def _dotted(func: ast.expr, imported: dict[str, str]) -> Optional[str]:
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in imported:
        return None
    return ".".join([imported[func.id], *reversed(parts)])


def _arguments(call: ast.Call) -> Optional[dict[str, ast.expr]]:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords) \
            or len(call.args) > len(_PARAMS):
        return None
    found = dict(zip(_PARAMS, call.args))
    for k in call.keywords:
        if k.arg in found or k.arg not in _PARAMS:
            return None
        found[k.arg] = k.value
    return found if "fn" in found else None


def rewrite(tree: ast.Module, imported: dict[str, str]) -> None:
    """Turn each statement ``mp.spawn(fn, args, nprocs)`` (joined, its value unused, ``fn`` a
    name) into a call of ``fn`` as the rank's own spawned process; ``imported``: the names the
    script's imports bind (`library_patches.imported_names`)."""

    class Spawns(ast.NodeTransformer):
        def visit_Expr(self, node: ast.Expr) -> ast.AST:
            call = node.value
            if not isinstance(call, ast.Call) or _dotted(call.func, imported) not in _SPAWNS:
                return node
            found = _arguments(call)
            join = found.get("join") if found else None
            if found is None or not isinstance(found["fn"], ast.Name) or \
                    (join is not None and not (isinstance(join, ast.Constant) and join.value is True)):
                return node  # another shape (join=False, fn an attribute): runs as written
            rt = ast.Name(id="__sg_rt__", ctx=ast.Load())
            rank = ast.Call(func=ast.Attribute(value=rt, attr="spawned_rank", ctx=ast.Load()),
                            args=[found.get("nprocs", ast.Constant(value=1))], keywords=[])
            args: list[ast.expr] = [rank]
            if "args" in found:
                args.append(ast.Starred(value=found["args"], ctx=ast.Load()))
            worker = ast.Call(func=found["fn"], args=args, keywords=[])
            joined = ast.Call(func=ast.Attribute(value=ast.Name(id="__sg_rt__", ctx=ast.Load()), attr="spawn_joined",
                                                 ctx=ast.Load()), args=[worker], keywords=[])
            return ast.copy_location(ast.Expr(value=joined), node)

    Spawns().visit(tree)
    ast.fix_missing_locations(tree)


def rank_of_spawned(nprocs: Any) -> int:
    """This rank's number among the processes the spawn would start; they must be the job's ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(nprocs) != world:
        raise RuntimeError(
            f"torch.multiprocessing.spawn(nprocs={nprocs}) in a job of {world} rank(s): each rank of the job "
            f"runs as one of the spawned processes, so submit the job with {nprocs} rank(s) (`singularityctl "
            f"submit --ranks {nprocs}`, `Client.submit(..., ranks={nprocs})`)")
    return int(os.environ.get("RANK", "0"))


def joined() -> None:
    """After the rank's spawned function returned: the parent's code after the spawn runs on rank
    0 only; another rank ends, as its spawned process would have."""
    if int(os.environ.get("RANK", "0")) != 0:
        raise SystemExit(0)
