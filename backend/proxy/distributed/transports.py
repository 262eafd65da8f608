"""The real process groups under one rank's `SingularityProcessGroup`, and allreduce over them.

A rank talks to the others through gloo (always: flags, ticks and host-staged transfers) and,
for CUDA tensors of a job whose ranks each have their own device, NCCL. When some slot holds
several ranks (a spliced job), a local group per slot and a group of slot leaders carry the
hierarchical reduction: local stage on the leader, exact exchange between leaders, local
broadcast. The reduction is exact (a tree fixed by logical rank, `exact.py`) or plain
(forwarded to gloo/NCCL); either way it carries the consistent cut's flag bits.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import exact
from .layout import RankLayout

#: the plain path copies a tensor to append the cut's counters only up to this size
PLAIN_FLAG_MAX_BYTES = 256 * 1024
REDUCTIONS = ("exact", "plain")


class Transports:
    """One rank's real groups, built over ``store`` with the physical ranks of ``placement``."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, inner: dict[str, str],
                 placement: RankLayout, reduction: str) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}")
        self.rank, self.size = rank, size
        self.placement = placement
        self.reduction = reduction
        self.timeout = timeout
        self.order = placement.order
        self.phys = placement.physical(rank)
        self.gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("sg/gloo/", store), self.phys, size, timeout)
        spliced = placement.max_per_slot > 1
        self.nccl: Any = None
        if inner.get("cuda") == "nccl" and not spliced:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("sg/nccl/", store), self.phys, size, opts)
        # hierarchical (local-first) reduction when some slot holds several ranks
        self.slot_index = placement.slot_of(rank)
        self.slot = placement.slots[self.slot_index]
        self._local: Any = None
        self._leaders: Any = None
        if spliced:
            if len(self.slot) > 1:
                self._local = dist.ProcessGroupGloo(dist.PrefixStore(f"sg/local/{self.slot_index}/", store),
                                                    self.slot.index(rank), len(self.slot), timeout)
            if rank == self.slot[0] and len(placement.slots) > 1:
                self._leaders = dist.ProcessGroupGloo(dist.PrefixStore("sg/leaders/", store),
                                                      self.slot_index, len(placement.slots), timeout)
        self._slot_layouts = [exact.cover(size, slot) for slot in placement.slots]
        self._flat_layouts = [[(r, r + 1)] for r in self.order]
        self._buffers = exact.Buffers()

    def close(self) -> None:
        """Destroy the groups now, on this thread, while the interpreter is whole: left to
        interpreter teardown, gloo's threads can outlive it and the process aborts at exit."""
        self.gloo = self.nccl = self._local = self._leaders = None

    def transport(self, t: torch.Tensor) -> tuple[Any, torch.device]:
        """The real group for a tensor, and the device its buffers must live on."""
        if t.is_cuda and self.nccl is not None:
            return self.nccl, t.device
        return self.gloo, torch.device("cpu")

    @staticmethod
    def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)

    def carries(self, nbytes: int, dtype: torch.dtype, op: Any) -> bool:
        """Whether an allreduce carries the cut's flags (the same answer on every rank).

        The exact path always does (8 bytes per gathered chunk).  The plain path must copy the
        tensor to append two counters, so only small SUMs carry them; the cut ticks otherwise.
        """
        if self.reduction == "exact":
            return True
        return (op == dist.ReduceOp.SUM and dtype != torch.bool and not dtype.is_complex
                and nbytes <= PLAIN_FLAG_MAX_BYTES)

    def allreduce_into(self, t: torch.Tensor, op: Any, bits: int, carry: bool) -> int:
        """Reduce ``t`` in place across the group; returns the OR of every rank's flag bits."""
        if self.reduction == "plain":
            return self._plain_allreduce(t, op, bits, carry)
        group, device = self.transport(t)
        direct = t.is_contiguous() and t.device == device
        flat = t.view(-1) if direct else t.reshape(-1).to(device)
        if self.placement.max_per_slot == 1:
            out_bits = exact.exchange_reduce(group, self.phys, self._flat_layouts, [flat], flat, op, self.size,
                                             bits, self._buffers, self.timeout)
        else:
            out_bits = self._hierarchical(flat, op, bits)
        if not direct:
            t.copy_(flat.view(t.shape))
        return out_bits

    def _hierarchical(self, flat: torch.Tensor, op: Any, bits: int) -> int:
        """Local stage on the slot's leader, exact exchange between leaders, local broadcast.

        ``flat`` is a contiguous CPU tensor; the reduction is written into it.
        """
        cpu = torch.device("cpu")
        numel, dtype = flat.numel(), flat.dtype
        slot = self.slot
        leader = self.rank == slot[0]
        size = exact.packed_size(numel, dtype)
        leaves: dict[int, torch.Tensor] = {self.rank: flat}
        if self._local is not None:
            packed = exact.pack(flat, bits, self._buffers.get("pack", size, cpu))
            gopts = dist.GatherOptions()
            gopts.rootRank = 0
            if leader:
                bufs = [self._buffers.get(f"member{i}", size, cpu) for i in range(len(slot))]
                self.wait(self._local.gather([bufs], [packed], gopts))
                for r, buf in zip(slot, bufs):
                    leaves[r], member_bits = exact.unpack(buf, numel, dtype)
                    bits |= member_bits
            else:
                self.wait(self._local.gather([], [packed], gopts))
        if leader:
            nodes = self._slot_layouts[self.slot_index]
            partials = exact.subtree_values(self.size, nodes, leaves, exact.combiner(op))
            if self._leaders is None:  # a single slot holds every rank
                bits = exact.exchange_reduce(None, 0, [nodes], partials, flat, op, self.size, bits,
                                             self._buffers, self.timeout)
            else:
                bits = exact.exchange_reduce(self._leaders, self.slot_index, self._slot_layouts, partials, flat,
                                             op, self.size, bits, self._buffers, self.timeout)
        if self._local is None:
            return bits
        packed = self._buffers.get("pack", size, cpu)
        if leader:
            exact.pack(flat, bits, packed)
        bopts = dist.BroadcastOptions()
        bopts.rootRank = 0
        self.wait(self._local.broadcast([packed], bopts))
        result, bits = exact.unpack(packed, numel, dtype)
        if not leader:
            flat.copy_(result)
        return bits

    def _plain_allreduce(self, t: torch.Tensor, op: Any, bits: int, carry: bool) -> int:
        """Forward to gloo/NCCL; with ``carry`` the flags ride as two extra counters of a SUM."""
        group, device = self.transport(t)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        if not carry:
            buf = self.staged(t, device)
            self.wait(group.allreduce([buf], opts))
            if buf is not t:
                t.copy_(buf)
            return 0
        n = t.numel()
        buf = self._buffers.get("plain", (n + 2) * t.element_size(), device).view(t.dtype)
        buf[:n].copy_(t.reshape(-1))
        buf[n:].copy_(torch.tensor([bits & 1, (bits >> 1) & 1], dtype=t.dtype))
        self.wait(group.allreduce([buf], opts))
        t.copy_(buf[:n].view(t.shape))
        counts = buf[n:].tolist()
        return (1 if counts[0] else 0) | (2 if counts[1] else 0)
