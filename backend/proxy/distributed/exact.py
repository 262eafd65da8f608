"""Reductions in an order fixed by logical rank, so their bits do not depend on placement.

Floating-point addition is not associative: an allreduce's result depends on the order in which
it combines the ranks' contributions.  gloo's ring and NCCL's rings and trees take that order
from the physical layout (who is next in the ring, which ranks share a node), so a job that moves
ranks around, or time-shares a device between several of them, would drift.  Here every element
is reduced by one fixed binary tree over the logical ranks ``0..W-1`` (`split`), whoever computes
it.  A group of co-located ranks can pre-reduce the subtrees it holds entirely (`cover`) without
changing a single bit, which is what makes "reduce locally first, then across devices" exact.

The cross-process step (`exchange_reduce`) is a reduce-scatter by chunks followed by an allgather,
the same traffic as a ring allreduce: contributor ``j`` receives chunk ``j`` of every partial,
evaluates the tree on it, and the results are gathered.  Data moves as raw bytes, so an 8-byte
flag word (the consistent-cut request bits) rides with each gathered chunk at no extra message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

Node = tuple[int, int]  # the logical ranks [lo, hi) of one subtree
FLAG_BYTES = 8
_ALIGN = 8  # chunk lengths are multiples of 8 elements, so every flag word stays 8-byte aligned


def split(node: Node) -> tuple[Node, Node]:
    """Children of a subtree: the left one is the largest power of two that leaves a right part.

    With power-of-two blocks on the left, any aligned block of S ranks (S a power of two dividing
    the world size) is itself a subtree, so co-located ranks reduce a whole subtree locally.
    """
    lo, hi = node
    n = hi - lo
    if n < 2:
        raise ValueError(f"a leaf {node} has no children")
    left = 1 << ((n - 1).bit_length() - 1)
    return (lo, lo + left), (lo + left, hi)


def cover(world: int, members: Sequence[int]) -> list[Node]:
    """The maximal subtrees whose ranks all belong to ``members``, in rank order."""
    inside = set(members)

    def walk(node: Node) -> list[Node]:
        lo, hi = node
        if all(r in inside for r in range(lo, hi)):
            return [node]
        if hi - lo == 1:
            return []
        a, b = split(node)
        return walk(a) + walk(b)

    return walk((0, world))


Combine = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _binary(fn: Callable[..., torch.Tensor]) -> Combine:
    def combine(x: torch.Tensor, y: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        return fn(x, y) if out is None else fn(x, y, out=out)
    return combine


_COMBINE: dict[Any, Combine] = {
    dist.ReduceOp.SUM: _binary(torch.add),
    dist.ReduceOp.AVG: _binary(torch.add),
    dist.ReduceOp.PRODUCT: _binary(torch.mul),
    dist.ReduceOp.MIN: _binary(torch.minimum),
    dist.ReduceOp.MAX: _binary(torch.maximum),
    dist.ReduceOp.BAND: _binary(torch.bitwise_and),
    dist.ReduceOp.BOR: _binary(torch.bitwise_or),
    dist.ReduceOp.BXOR: _binary(torch.bitwise_xor),
}


def combiner(op: Any) -> Combine:
    """The elementwise combine for a `ReduceOp` (AVG sums; `finish` divides)."""
    for key, fn in _COMBINE.items():
        if op == key:
            return fn
    raise ValueError(f"reduce op {op!r} is not supported by the exact reduction")


def check_op(op: Any, dtype: torch.dtype) -> None:
    """Fail at issue time (not inside a future) for what the exact path cannot do."""
    combiner(op)
    if op == dist.ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype}")


def finish(op: Any, value: torch.Tensor, world: int) -> torch.Tensor:
    if op == dist.ReduceOp.AVG:
        value.div_(world)
    return value


def evaluate(world: int, known: Mapping[Node, torch.Tensor], combine: Combine,
             out: Optional[torch.Tensor] = None,
             scratch: Optional[Callable[[int], torch.Tensor]] = None) -> torch.Tensor:
    """Evaluate the tree over ``0..world-1`` from precomputed subtrees (``known`` must cover it).

    The root is written into ``out`` when given (else into new memory).  Intermediate results
    go into ``scratch(i)`` tensors (reused buffers; new memory without it) and are updated in
    place where possible; the inputs are never written.
    """
    used = [0]

    def temp(like: torch.Tensor) -> Optional[torch.Tensor]:
        if scratch is None:
            return None
        used[0] += 1
        return scratch(used[0] - 1)[:like.numel()].view_as(like)

    def ev(node: Node, dest: Optional[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        t = known.get(node)
        if t is not None:
            return t, False
        if node[1] - node[0] == 1:
            raise KeyError(f"rank {node[0]}'s contribution is missing")
        a, b = split(node)
        x, x_owned = ev(a, None)
        y, _ = ev(b, None)
        if dest is None:
            dest = x if x_owned else temp(x)
        return combine(x, y, dest), True

    value, owned = ev((0, world), out)
    if out is not None:
        if value is not out:
            out.copy_(value)
        return out
    return value if owned else value.clone()


def subtree_values(world: int, nodes: Sequence[Node], leaves: Mapping[int, torch.Tensor],
                   combine: Combine) -> list[torch.Tensor]:
    """Values of ``nodes`` (each a subtree whose leaves are all in ``leaves``), tree order kept."""
    known = {(r, r + 1): t for r, t in leaves.items()}
    out = []
    for node in nodes:
        if node in known:
            out.append(known[node])
            continue
        sub_world = node[1] - node[0]
        shifted = {(r - node[0], r - node[0] + 1): t for r, t in leaves.items() if node[0] <= r < node[1]}
        out.append(evaluate(sub_world, shifted, combine))
    return out


class Buffers:
    """Reused byte buffers, a few per purpose.

    DDP reduces the same bucket sizes every step, and fresh multi-MB allocations cost more than
    the reduction itself where page faults are slow (4 ms for 1 MB on this project's CI VMs).
    """

    def __init__(self, per_name: int = 4) -> None:
        self._per_name = per_name
        self._cache: dict[tuple[str, int, str], torch.Tensor] = {}
        self._order: list[tuple[str, int, str]] = []

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (name, nbytes, str(device))
        buf = self._cache.get(key)
        if buf is None:
            same = [k for k in self._order if k[0] == name]
            if len(same) >= self._per_name:
                self._order.remove(same[0])
                del self._cache[same[0]]
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._cache[key] = buf
        else:
            self._order.remove(key)
        self._order.append(key)
        return buf


def _wait(work: Any, timeout: Optional[timedelta]) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _chunk_len(numel: int, parts: int) -> int:
    per = max(1, -(-numel // parts))
    return -(-per // _ALIGN) * _ALIGN


def _flag_view(buf: torch.Tensor, offset: int) -> torch.Tensor:
    return buf[offset:offset + FLAG_BYTES].view(torch.int64)


#: tensors above this are reduced in segments of this size, pipelined: the tree of one segment
#: is evaluated while the transport moves the others (gloo pipelines its own ring the same way)
SEGMENT_BYTES = 8 << 20


@dataclass
class _Segment:
    """One pipelined piece of an exchange: elements [lo, hi) of the flat tensors."""

    index: int
    lo: int
    hi: int
    chunk: int = 0
    lens: list = field(default_factory=list)
    recv: Optional[torch.Tensor] = None
    out_splits: list = field(default_factory=list)
    widths: list = field(default_factory=list)
    piece: Optional[torch.Tensor] = None
    gathered: Optional[torch.Tensor] = None
    work: Any = None


def exchange_reduce(group: Any, index: int, layouts: Sequence[Sequence[Node]],
                    partials: Sequence[torch.Tensor], out: torch.Tensor, op: Any, world: int, flag: int,
                    buffers: Optional[Buffers] = None, timeout: Optional[timedelta] = None) -> int:
    """Reduce across ``group`` (one member per entry of ``layouts``) in the fixed tree order.

    Member ``index`` holds ``partials``: flat tensors shaped like ``out``, the values of the
    subtrees ``layouts[index]``.  Together the layouts cover the tree.  Writes the reduction into
    ``out`` (flat, contiguous; it may be one of the partials) and returns the bitwise OR of every
    member's ``flag``.

    Per segment: phase 1 (alltoall) sends chunk j of the partials to member j (a member with one
    partial sends straight from its memory); member j evaluates the tree on its chunk; phase 2
    (allgather) returns the chunks, each followed by its member's flag word, so every member sees
    all W flags and the flags need no reduction step of their own.  All alltoalls are issued
    first, so the transport works on later segments while earlier ones are evaluated.
    """
    combine = combiner(op)
    numel, dtype, device = out.numel(), out.dtype, out.device
    size = len(layouts)
    if size == 1:
        known = dict(zip(layouts[0], partials))
        if len(known) > 1 and any(p.data_ptr() == out.data_ptr() for p in partials):
            out.copy_(evaluate(world, known, combine))  # out is an input read after the root write
        else:
            evaluate(world, known, combine, out)
        finish(op, out, world)
        return flag
    buffers = buffers or Buffers()
    isz = dtype.itemsize
    fb = max(FLAG_BYTES, isz)
    step = max(_ALIGN * size, SEGMENT_BYTES // isz)
    segments = [_Segment(i, lo, min(numel, lo + step)) for i, lo in enumerate(range(0, max(numel, 1), step))]
    flat_partials = [p.reshape(-1) for p in partials]

    for seg in segments:  # phase 1, all issued before any is waited for
        n = seg.hi - seg.lo
        seg.chunk = _chunk_len(n, size)
        seg.lens = [max(0, min(seg.chunk, n - d * seg.chunk)) for d in range(size)]
        k = len(partials)
        if k == 1:
            send = flat_partials[0][seg.lo:seg.hi].contiguous().view(torch.uint8)
            in_splits = [m * isz for m in seg.lens]
        else:
            send = buffers.get(f"send{seg.index}", size * k * seg.chunk * isz, device)
            data = send.view(dtype).view(size, k, seg.chunk)
            full, rem = divmod(n, seg.chunk)
            for j, p in enumerate(flat_partials):
                p = p[seg.lo:seg.hi]
                if full:
                    data[:full, j, :].copy_(p[:full * seg.chunk].view(full, seg.chunk))
                if rem:
                    data[full, j, :rem].copy_(p[full * seg.chunk:])
            in_splits = [k * seg.chunk * isz] * size
        mine = seg.lens[index]
        seg.widths = [mine if len(layouts[s]) == 1 else seg.chunk for s in range(size)]
        seg.out_splits = [len(layouts[s]) * seg.widths[s] * isz for s in range(size)]
        total = sum(seg.out_splits)
        seg.recv = buffers.get(f"recv{seg.index}", max(1, total), device)[:total]
        seg.work = group.alltoall_base(seg.recv, send, seg.out_splits, in_splits, dist.AllToAllOptions())

    for seg in segments:  # evaluate, then phase 2 (issued, not waited for)
        _wait(seg.work, timeout)
        chunk, mine = seg.chunk, seg.lens[index]
        seg.piece = piece = buffers.get(f"piece{seg.index}", chunk * isz + fb, device)
        if mine:
            known: dict[Node, torch.Tensor] = {}
            offset = 0
            for s in range(size):
                values = seg.recv[offset:offset + seg.out_splits[s]].view(dtype).view(len(layouts[s]), seg.widths[s])
                for j, node in enumerate(layouts[s]):
                    known[node] = values[j, :mine]
                offset += seg.out_splits[s]

            def scratch(i: int, _n: int = mine) -> torch.Tensor:
                return buffers.get(f"tmp{i}", _n * isz, device).view(dtype)  # type: ignore[union-attr]

            finish(op, evaluate(world, known, combine, piece[:mine * isz].view(dtype), scratch), world)
        _flag_view(piece, chunk * isz).fill_(flag)
        seg.gathered = buffers.get(f"gathered{seg.index}", size * piece.numel(), device)
        seg.work = group._allgather_base(seg.gathered, piece, AllgatherOptions())

    bits = 0
    for seg in segments:
        _wait(seg.work, timeout)
        chunk = seg.chunk
        g = seg.gathered.view(size, -1)  # type: ignore[union-attr]
        result = g[:, :chunk * isz].view(dtype)
        dest = out[seg.lo:seg.hi]
        full, rem = divmod(seg.hi - seg.lo, chunk)
        if full:
            dest[:full * chunk].view(full, chunk).copy_(result[:full])
        if rem:
            dest[full * chunk:].copy_(result[full, :rem])
        for f in g[:, chunk * isz:chunk * isz + FLAG_BYTES].view(torch.int64).reshape(-1).tolist():
            bits |= int(f)
    return bits


def packed_size(numel: int, dtype: torch.dtype) -> int:
    """Bytes of a tensor's data followed by an aligned 8-byte flag word (`pack`)."""
    return -(-numel * dtype.itemsize // FLAG_BYTES) * FLAG_BYTES + max(FLAG_BYTES, dtype.itemsize)


def pack(flat: torch.Tensor, flag: int, buf: torch.Tensor) -> torch.Tensor:
    """Write a flat tensor's bytes and ``flag`` into ``buf`` (of `packed_size` bytes)."""
    n = flat.numel() * flat.element_size()
    if n:
        buf[:n].copy_(flat.reshape(-1).view(torch.uint8))
    head = -(-n // FLAG_BYTES) * FLAG_BYTES
    _flag_view(buf, head).fill_(flag)
    return buf


def unpack(buf: torch.Tensor, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    n = numel * dtype.itemsize
    head = -(-n // FLAG_BYTES) * FLAG_BYTES
    return buf[:n].view(dtype), int(_flag_view(buf, head).item())
