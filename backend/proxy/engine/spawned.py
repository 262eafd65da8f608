"""``torch.multiprocessing.spawn`` in a job: each rank of the job is one of the spawned processes.

The DDP tutorial's shape, and the ImageNet example's, is a parent that spawns one process per
device, ``mp.spawn(main_worker, args=(world_size, args), nprocs=world_size)``, each of which joins
the process group as rank ``i``. A job already runs one process per rank, so such a script spawned
``W × W`` processes, which fought over the script's fixed rendezvous port and escaped the engine.

So the rewrite turns the statement into a call of the function itself (`rewrite`):

    if __sg_rt__.spawns_ranks(world_size):
        __sg_rt__.spawn_joined(main_worker(__sg_rt__.spawned_rank(), *(world_size, args)))
    else:
        mp.spawn(main_worker, args=(world_size, args), nprocs=world_size)

Every rank runs the script's code up to the spawn as the parent would (argparse, reading the
config), then runs ``main_worker`` as spawned process number RANK. ``main_worker`` is called
from a call site of the program, so its loops are safe points like those of ``main()``. What the
parent does after the spawn returned runs on rank 0, once its own process returned
(`spawn_joined`: the other ranks end there, as spawned processes do); it does not wait for the
others. ``nprocs`` must be the job's number of ranks: a job of several ranks that spawns another
number fails saying so; a one-rank job that spawns several processes (workers that preprocess
shards, or a DDP script submitted without ``--ranks``) spawns them as written, with a warning that
no checkpoint can be taken while they run (`spawns_ranks`).
"""
from __future__ import annotations

import ast
import copy
import os
import warnings
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
            nprocs = found.get("nprocs", ast.Constant(value=1))
            args: list[ast.expr] = [ast.Call(func=ast.Attribute(value=rt, attr="spawned_rank", ctx=ast.Load()),
                                             args=[], keywords=[])]
            if "args" in found:
                args.append(ast.Starred(value=copy.deepcopy(found["args"]), ctx=ast.Load()))
            worker = ast.Call(func=copy.deepcopy(found["fn"]), args=args, keywords=[])  # the original stays whole
            joined = ast.Call(func=ast.Attribute(value=rt, attr="spawn_joined", ctx=ast.Load()), args=[worker],
                              keywords=[])
            test = ast.Call(func=ast.Attribute(value=rt, attr="spawns_ranks", ctx=ast.Load()),
                            args=[copy.deepcopy(nprocs)], keywords=[])
            branch = ast.If(test=test, body=[ast.copy_location(ast.Expr(value=joined), node)], orelse=[node])
            return ast.copy_location(branch, node)

    Spawns().visit(tree)
    ast.fix_missing_locations(tree)


def spawns_ranks(nprocs: Any) -> bool:
    """Whether the spawn's processes are the job's ranks (each rank then runs one of them);
    False for a one-rank job that spawns several, which spawns them as written."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(nprocs) == world:
        return True
    if world > 1:
        raise RuntimeError(
            f"torch.multiprocessing.spawn(nprocs={nprocs}) in a job of {world} ranks: each rank of the job "
            f"runs as one of the spawned processes, so submit the job with {nprocs} rank(s) (`singularityctl "
            f"submit --ranks {nprocs}`, `Client.submit(..., ranks={nprocs})`)")
    warnings.warn(
        f"torch.multiprocessing.spawn(nprocs={nprocs}) in a one-rank job starts {nprocs} processes the engine "
        f"does not see: no checkpoint can be taken while they run. If they form a process group, submit the "
        f"job with {nprocs} ranks (`--ranks {nprocs}`): each rank then runs as one of them", RuntimeWarning,
        stacklevel=3)
    return False


def rank_of_spawned() -> int:
    """This rank's number among the spawned processes (`spawns_ranks` said they are the ranks)."""
    return int(os.environ.get("RANK", "0"))


def joined() -> None:
    """After the rank's spawned function returned: the parent's code after the spawn runs on rank
    0 only; another rank ends, as its spawned process would have."""
    if int(os.environ.get("RANK", "0")) != 0:
        raise SystemExit(0)
