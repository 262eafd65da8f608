"""The proxy's collective backend: a c10d ``ProcessGroup`` that wraps gloo (and NCCL).

`install()` makes the user's ``dist.init_process_group("gloo" | "nccl" | None)`` create a
`SingularityProcessGroup` instead, registered as the c10d backend ``"singularity"``; the user's
DDP code runs unmodified on top of it.  The group

* reduces in an order fixed by logical rank (`exact.py`), so results are bitwise identical
  whatever the placement (``SINGULARITY_REDUCTION=plain`` forwards to gloo/NCCL instead);
* carries the consistent-cut flag word on every allreduce (`cut.py`);
* reduces co-located ranks' contributions locally first and lets them take turns on their slot
  when ``SINGULARITY_PLACEMENT`` puts several ranks in one slot (`splice.py`).

Pitfalls of Python process groups it deals with (see torchft and torch's own code): the C++ side
keeps the ``(rank, size)`` given to the constructor, so the group is built with the logical
ones; a ``Work``'s future resolves to the output tensors, never to None or an exception (DDP's
reducer crashes the process on those; errors travel beside it, see `work.FutureWork`);
``_set_group_name`` is mirrored in Python (the C++ getter reads a backend this group does not
have); DDP issues allgather (parameter shape check) and broadcast (module states) at
construction, broadcasts again after its first step (rebuilt buckets) and, with
``find_unused_parameters``, allreduces an int map every step; the transport groups are destroyed
in `shutdown` (left to interpreter teardown, gloo's threads abort the process at exit).

Collectives run one at a time, in issue order, on one worker thread per group (`work.py`).
"""
from __future__ import annotations

import atexit
import functools
import inspect
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import AllgatherOptions
from torch.futures import Future

from backend.contract import ENV_RENDEZVOUS, EXIT_COLLECTIVE_FAILED

from . import exact
from .cut import ConsistentCut, default_cut
from .layout import RankLayout
from .splice import TurnRing
from .transports import REDUCTIONS, Transports
from .work import CollectiveThread, CudaFence, FutureWork, QueuedCollective

__all__ = ["BACKEND_NAME", "EXIT_COLLECTIVE_FAILED", "Options", "SingularityProcessGroup", "default_group",
           "inner_backends", "install", "register", "restore_process_group", "uninstall"]

BACKEND_NAME = "singularity"
REDUCTION_ENV = "SINGULARITY_REDUCTION"
#: "0" lets co-located ranks compute concurrently (to measure what turn-taking costs)
TURNS_ENV = "SINGULARITY_TURNS"


# ---------------------------------------------------------------------------- configuration
@dataclass
class Options:
    """What the patched ``init_process_group`` hands our creator (as its ``pg_options``)."""

    inner: dict[str, str]  # device type -> transport backend ("gloo" / "nccl")
    wrapped: str  # the backend the user asked for, as they wrote it
    reduction: str = ""
    user_options: Any = None


def inner_backends(backend: Any) -> dict[str, str]:
    """Device type -> real backend for what the user passed to ``init_process_group``."""
    text = str(backend).lower() if backend is not None else ""
    if text in ("", "undefined", "none", BACKEND_NAME):
        mapping = {"cpu": "gloo"}
        if torch.cuda.is_available() and dist.is_nccl_available():
            mapping["cuda"] = "nccl"
        return mapping
    if ":" in text:
        mapping = {}
        for part in text.split(","):
            device, _, name = part.partition(":")
            mapping[device.strip()] = name.strip()
    else:
        mapping = {"cpu": text, "cuda": text}
    mapping["cpu"] = "gloo"  # flags, ticks and host-staged transfers always need a CPU group
    for device, name in mapping.items():
        if name not in ("gloo", "nccl"):
            raise ValueError(f"the singularity backend wraps gloo and nccl, not {name!r} (for {device})")
    if "nccl" in mapping.values() and not dist.is_nccl_available():
        raise RuntimeError("Distributed package doesn't have NCCL built in")  # torch's own message
    return mapping


def _reduction(options: Optional[Options]) -> str:
    value = (options.reduction if options is not None and options.reduction else
             os.environ.get(REDUCTION_ENV, "exact")).strip().lower() or "exact"
    if value not in REDUCTIONS:
        raise ValueError(f"{REDUCTION_ENV}={value!r}: expected one of {REDUCTIONS}")
    return value


def _reduce_op(opts: Any) -> Any:
    if opts is None:
        return dist.ReduceOp.SUM
    if isinstance(opts, (dist.AllreduceOptions, dist.AllreduceCoalescedOptions, dist.ReduceScatterOptions)):
        return opts.reduceOp
    return opts  # a ReduceOp passed positionally


def _one(tensors: Any, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    tensors = list(tensors)
    if len(tensors) != 1:
        raise ValueError(f"{what}: the singularity backend takes one tensor per rank (one device per "
                         f"process), got {len(tensors)}")
    return tensors[0]


#: how long rank 0, whose process holds the job's rendezvous store, waits at its exit for the
#: other ranks to leave (`SingularityProcessGroup._leave_last`)
DEPARTURE_WAIT_S = 10.0


# ---------------------------------------------------------------------------- the process group
class SingularityProcessGroup(dist.ProcessGroup):
    """One rank's view of a job's collectives: logical ranks outside, placement inside."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, inner: dict[str, str],
                 placement: RankLayout, reduction: str = "exact", cut: Optional[ConsistentCut] = None,
                 wrapped: str = "gloo", turns: bool = False, job_turns: Optional[TurnRing] = None) -> None:
        super().__init__(rank, size)
        if placement.world_size != size:
            raise ValueError(f"placement {placement.text()!r} does not match group size {size}")
        self._rank, self._size = rank, size
        self.placement = placement
        self.reduction = reduction
        self.inner = dict(inner)
        self.wrapped_backend = wrapped
        self._links = Transports(store, rank, size, timeout, self.inner, placement, reduction)
        self._order = placement.order
        self._name: Optional[str] = None
        self._desc = ""
        self._issue_lock = threading.Lock()
        self._cut = cut
        self._worker = CollectiveThread(f"singularity-pg-{rank}", cut._resolve if cut is not None else None)
        self._turns: Optional[TurnRing] = None
        #: a subgroup of a spliced job yields the default group's ring (it never splits a slot)
        self._job_turns = job_turns
        slot = self._links.slot
        if turns and len(slot) > 1:
            self._turns = TurnRing(dist.PrefixStore(f"sg/turn/{self._links.slot_index}/", store),
                                   slot.index(rank), len(slot), timeout)
        self._closed = False
        #: the default group: where its ranks count their departures (see `_leave_last`)
        self._departures = dist.PrefixStore("sg/exit/", store) if cut is not None and size > 1 else None
        _LIVE.add(self)
        if cut is not None:
            cut.attach(self)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        if self._name is None:
            raise ValueError("the process group's name is not set yet")
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    @property
    def turns(self) -> Optional[TurnRing]:
        return self._turns

    @property
    def _ring(self) -> Optional[TurnRing]:
        """The turns this group's ranks take on a shared device (its own, or the job's)."""
        return self._turns if self._turns is not None else self._job_turns

    def start_turns(self) -> None:
        """Begin taking turns (after ``init_process_group`` returns: it may hold a barrier)."""
        if self._turns is not None and not self._turns.holding:
            self._turns.start()

    def __repr__(self) -> str:
        return (f"SingularityProcessGroup(rank={self._rank}, size={self._size}, wraps={self.wrapped_backend!r}, "
                f"reduction={self.reduction!r}, placement={self.placement.text()!r})")

    # ------------------------------------------------------------------ plumbing
    def _issue(self, run: Callable[[int], tuple[Any, int]], tensors: Sequence[torch.Tensor],
               flagged: bool = False, outputs: Optional[Sequence[torch.Tensor]] = None) -> Any:
        devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        work = FutureWork(Future(devices=devices) if devices else Future())
        fence = CudaFence(devices) if devices else None
        with self._issue_lock:
            if self._closed:
                raise RuntimeError("this process group was shut down")
            cut = self._cut
            flagged = flagged and cut is not None
            bits = cut._outgoing() if flagged else 0  # type: ignore[union-attr]
            self._worker.submit(QueuedCollective(run, work, list(outputs if outputs is not None else tensors), flagged,
                                     bits, fence))
            if cut is not None and not flagged and cut._tick_due():
                # right behind this collective, at the same place of every rank's sequence
                self._worker.submit(QueuedCollective(self._exchange_flags, FutureWork(Future()), [], True,
                                                     cut._outgoing(), None))
        if self._ring is not None:
            self._ring.yield_turn()
        return work

    # ------------------------------------------------------------------ the cut's channel
    def confirm(self, word: int) -> int:
        return self._exchange_flags(word)[1]

    def step_aside(self) -> None:
        if self._ring is not None:
            self._ring.suspend()

    def step_back(self) -> None:
        if self._ring is not None:
            self._ring.resume()

    def _exchange_flags(self, bits: int) -> tuple[Any, int]:
        """An explicit 8-byte flag exchange (a tick): the OR of every rank's bits."""
        buf = torch.full((1,), bits, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BOR
        self._links.wait(self._links.gloo.allreduce([buf], opts))
        return [buf], int(buf.item())

    def drain(self) -> None:
        self._worker.drain()

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        t = _one(tensors, "allreduce")
        op = _reduce_op(opts)
        if t.layout != torch.strided:
            raise ValueError("the singularity backend reduces dense tensors only")
        exact.check_op(op, t.dtype)

        carry = self._links.carries(t.numel() * t.element_size(), t.dtype, op)

        def run(bits: int) -> tuple[Any, int]:
            return [t], self._links.allreduce_into(t, op, bits, carry)

        return self._issue(run, [t], flagged=carry)

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        tensors = list(tensors)
        op = _reduce_op(opts)
        if len({t.dtype for t in tensors}) > 1 or len({t.device for t in tensors}) > 1:
            raise ValueError("allreduce_coalesced needs tensors of one dtype on one device")
        dtype = tensors[0].dtype if tensors else torch.float32
        exact.check_op(op, dtype)
        carry = self._links.carries(sum(t.numel() * t.element_size() for t in tensors), dtype, op)

        def run(bits: int) -> tuple[Any, int]:
            if not tensors:
                return [], self._links.allreduce_into(torch.empty(0), op, bits, carry)  # still carries the flags
            flat = torch.cat([t.reshape(-1) for t in tensors])
            out_bits = self._links.allreduce_into(flat, op, bits, carry)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            return tensors, out_bits

        return self._issue(run, tensors, flagged=carry)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        t = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None and not isinstance(opts, int) else int(opts or 0)

        def run(_bits: int) -> tuple[Any, int]:
            group, device = self._links.transport(t)
            buf = self._links.staged(t, device)
            o = dist.BroadcastOptions()
            o.rootRank = self.placement.physical(root)
            o.rootTensor = 0
            self._links.wait(group.broadcast([buf], o))
            if buf is not t:
                t.copy_(buf)
            return [t], 0

        return self._issue(run, [t])

    def _gather_into(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[i]`` <- logical rank i's ``inp``."""
        group, device = self._links.transport(inp)
        staged = [self._links.staged(o, device) for o in outs]
        phys_outs = [staged[self._order[p]] for p in range(self._size)]
        self._links.wait(group.allgather([phys_outs], [self._links.staged(inp, device)], AllgatherOptions()))
        for o, s in zip(outs, staged):
            if s is not o:
                o.copy_(s)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        inp = _one(input_tensors, "allgather")
        outs = list(output_tensors[0]) if output_tensors and isinstance(output_tensors[0], (list, tuple)) \
            else list(output_tensors)
        if len(outs) != self._size:
            raise ValueError(f"allgather needs {self._size} output tensors, got {len(outs)}")

        def run(_bits: int) -> tuple[Any, int]:
            self._gather_into(outs, inp)
            return outs, 0

        return self._issue(run, outs + [inp], outputs=outs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if output.numel() != input.numel() * self._size:
            raise ValueError("allgather_into_tensor: output must hold world_size inputs")

        def run(_bits: int) -> tuple[Any, int]:
            self._gather_into(list(output.reshape(self._size, -1).unbind(0)), input.reshape(-1))
            return [output], 0

        return self._issue(run, [output, input], outputs=[output])

    def allgather_into_tensor_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> Any:
        outputs, inputs = list(outputs), list(inputs)

        def run(_bits: int) -> tuple[Any, int]:
            for o, i in zip(outputs, inputs):
                self._gather_into(list(o.reshape(self._size, -1).unbind(0)), i.reshape(-1))
            return outputs, 0

        return self._issue(run, outputs + inputs, outputs=outputs)

    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]], input_list: Sequence[torch.Tensor],
                            opts: Any = None) -> Any:
        output_lists = [list(o) for o in output_lists]
        input_list = list(input_list)

        def run(_bits: int) -> tuple[Any, int]:
            for outs, inp in zip(output_lists, input_list):
                self._gather_into(outs, inp)
            return [t for outs in output_lists for t in outs], 0

        return self._issue(run, input_list, outputs=[t for outs in output_lists for t in outs])

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        inp = _one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        outs = list(output_tensors[0]) if output_tensors else []

        def run(_bits: int) -> tuple[Any, int]:
            o = dist.GatherOptions()
            o.rootRank = self.placement.physical(root)
            cpu = torch.device("cpu")
            staged = [self._links.staged(t, cpu) for t in outs]
            phys = [[staged[self._order[p]] for p in range(self._size)]] if outs else []
            self._links.wait(self._links.gloo.gather(phys, [self._links.staged(inp, cpu)], o))
            for t, s in zip(outs, staged):
                if s is not t:
                    t.copy_(s)
            return outs, 0

        return self._issue(run, outs + [inp], outputs=outs)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        out = _one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        ins = list(input_tensors[0]) if input_tensors else []

        def run(_bits: int) -> tuple[Any, int]:
            o = dist.ScatterOptions()
            o.rootRank = self.placement.physical(root)
            cpu = torch.device("cpu")
            buf = self._links.staged(out, cpu)
            phys = [[self._links.staged(ins[self._order[p]], cpu) for p in range(self._size)]] if ins else []
            self._links.wait(self._links.gloo.scatter([buf], phys, o))
            if buf is not out:
                out.copy_(buf)
            return [out], 0

        return self._issue(run, [out] + ins, outputs=[out])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> Any:
        def splits(t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
            sizes = list(sizes) or [t.shape[0] // self._size] * self._size
            return list(torch.split(t, sizes, dim=0))

        def run(_bits: int) -> tuple[Any, int]:
            cpu = torch.device("cpu")
            ins = splits(self._links.staged(input, cpu), input_split_sizes)
            outs_logical = splits(output, output_split_sizes)
            phys_in = [ins[self._order[p]] for p in range(self._size)]
            phys_out_sizes = [o.shape[0] for o in (outs_logical[self._order[p]] for p in range(self._size))]
            send = torch.cat(phys_in) if phys_in else input
            recv = torch.empty((sum(phys_out_sizes),) + tuple(output.shape[1:]), dtype=output.dtype)
            self._links.wait(self._links.gloo.alltoall_base(recv, send.contiguous(), phys_out_sizes,
                                                [t.shape[0] for t in phys_in], dist.AllToAllOptions()))
            for p, part in enumerate(torch.split(recv, phys_out_sizes, dim=0)):
                outs_logical[self._order[p]].copy_(part)
            return [output], 0

        return self._issue(run, [output, input], outputs=[output])

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        out = _one(output_tensors, "reduce_scatter")
        ins = list(input_tensors[0]) if isinstance(input_tensors[0], (list, tuple)) else list(input_tensors)
        op = _reduce_op(opts)
        exact.check_op(op, out.dtype)

        carry = self._links.carries(sum(t.numel() * t.element_size() for t in ins), out.dtype, op)

        def run(bits: int) -> tuple[Any, int]:
            flat = torch.cat([t.reshape(-1) for t in ins])
            out_bits = self._links.allreduce_into(flat, op, bits, carry)
            n = out.numel()
            out.copy_(flat[self._rank * n:(self._rank + 1) * n].view(out.shape))
            return [out], out_bits

        return self._issue(run, [out] + ins, flagged=carry, outputs=[out])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts)
        exact.check_op(op, output.dtype)

        carry = self._links.carries(input.numel() * input.element_size(), input.dtype, op)

        def run(bits: int) -> tuple[Any, int]:
            flat = input.reshape(-1).clone()
            out_bits = self._links.allreduce_into(flat, op, bits, carry)
            n = output.numel()
            output.copy_(flat[self._rank * n:(self._rank + 1) * n].view(output.shape))
            return [output], out_bits

        return self._issue(run, [output, input], flagged=carry, outputs=[output])

    def barrier(self, opts: Any = None) -> Any:
        def run(_bits: int) -> tuple[Any, int]:
            self._links.wait(self._links.gloo.barrier(dist.BarrierOptions()))
            return [], 0

        return self._issue(run, [])

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the worker after the queued collectives; called by ``destroy_process_group``."""
        with self._issue_lock:
            if self._closed:
                return
            self._closed = True
        if self._cut is not None:
            self._cut.leave()  # a confirmation waiting for this rank's next move gets "not ready"
        self._worker.drain()
        self._worker.stop()
        if self._cut is not None:
            self._cut.detach(self)
        if self._turns is not None:
            self._turns.leave()
        self._leave_last()
        self._links.close()

    def _leave_last(self) -> None:
        """The job's rendezvous store lives in rank 0's process, and a rank that shares its device
        still needs it after the last collective, to be handed its turn back: rank 0 leaves only
        once every rank has (at most DEPARTURE_WAIT_S: a rank that died never comes)."""
        if self._departures is None:
            return
        try:
            self._departures.add("left", 1)
            deadline = time.monotonic() + DEPARTURE_WAIT_S
            while self._rank == 0 and self._departures.add("left", 0) < self._size and time.monotonic() < deadline:
                time.sleep(0.005)
        except (RuntimeError, OSError):  # DistNetworkError / DistStoreError: rank 0 is gone already
            pass

    def abort(self) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------- registration
_STATE: dict[str, Any] = {}
_LIVE: "weakref.WeakSet[SingularityProcessGroup]" = weakref.WeakSet()


@atexit.register
def shutdown_all() -> None:
    """Stop worker threads and hand on device turns before the process ends (a program may never
    destroy its group; a rank stopping at a checkpoint leaves with ``os._exit``)."""
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway; a broken group must not hide the program's own status
            pass


def _create(dist_opts: Any, options: Any) -> SingularityProcessGroup:
    """The c10d creator (extended API): it receives the group's store, ranks and timeout."""
    opts = options if isinstance(options, Options) else _STATE.get("default_options")
    if opts is None:
        opts = Options(inner_backends(None), BACKEND_NAME)
    members = list(dist_opts.global_ranks_in_group or range(dist_opts.group_size))
    is_default = not dist.is_initialized()
    world = dist_opts.group_size if is_default else dist.get_world_size()
    placement = RankLayout.from_env(world)
    if not is_default:
        placement = placement.restrict(members)
    timeout = dist_opts.timeout if isinstance(dist_opts.timeout, timedelta) else timedelta(minutes=30)
    parent = None if is_default else default_group()
    pg = SingularityProcessGroup(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, timeout, opts.inner, placement,
        _reduction(opts), cut=default_cut() if is_default else None, wrapped=opts.wrapped,
        turns=is_default and os.environ.get(TURNS_ENV, "1") != "0",
        job_turns=parent.turns if parent is not None else None)
    if is_default:
        _STATE["default_options"] = opts
        _STATE["default_pg"] = pg
    return pg


def register() -> None:
    """Register the ``"singularity"`` c10d backend (idempotent).  Devices are not claimed."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _patched_init(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        user_options = bound.arguments.get("pg_options")
        wrapped = str(backend) if backend is not None else ("nccl" if torch.cuda.is_available() else "gloo")
        bound.arguments["backend"] = BACKEND_NAME
        bound.arguments["pg_options"] = Options(inner_backends(backend), wrapped, _STATE.get("reduction", ""),
                                                user_options)
        bound.arguments.pop("device_id", None)  # the proxy maps devices: each rank's is cuda:0
        if os.environ.get(ENV_RENDEZVOUS) and bound.arguments.get("store") is None:
            _job_rendezvous(bound.arguments, os.environ[ENV_RENDEZVOUS])
        result = original(*bound.args, **bound.kwargs)
        pg = default_group()
        if pg is not None:
            pg.start_turns()
        return result

    init_process_group.__singularity_original__ = original  # type: ignore[attr-defined]
    return init_process_group


def _job_rendezvous(arguments: dict[str, Any], rendezvous: str) -> None:
    """Meet at the job's rendezvous, whatever the script names: ``init_method="tcp://10.1.1.20:23456"``
    (the ImageNet example) or ``os.environ["MASTER_PORT"] = "12355"`` (the DDP tutorial) put every job
    on one fixed port of one host, so two jobs on a node collided and a rank on another node
    looked for its peers on its own host. A rank or world size the script passes must be the job's."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for name, value in (("rank", rank), ("world_size", world)):
        given = arguments.get(name)
        if given is not None and int(given) != -1 and int(given) != value:
            raise ValueError(f"init_process_group({name}={given}) in rank {rank} of a job of {world} rank(s): "
                             f"the script's {name} must be the job's; submit the job with the number of ranks "
                             f"the script expects (`--ranks`), or take them from the RANK and WORLD_SIZE "
                             f"environment variables")
    arguments.update(init_method=f"tcp://{rendezvous}", rank=rank, world_size=world)


def _patched_new_group(original: Callable[..., Any]) -> Callable[..., Any]:
    """Subgroups asking for gloo/nccl by name are wrapped too: a raw gloo collective would
    bypass the exact order, and under splicing block a rank that holds its slot's turn."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is not None and str(backend).lower() != BACKEND_NAME and default_group() is not None:
            bound.arguments["backend"] = BACKEND_NAME
            bound.arguments["pg_options"] = Options(inner_backends(backend), str(backend),
                                                    _STATE.get("reduction", ""), bound.arguments.get("pg_options"))
        pg = default_group()
        turns = pg.turns if pg is not None else None
        if turns is not None:
            members = bound.arguments.get("ranks") or range(pg.size())  # type: ignore[union-attr]
            split = pg.placement.splits(list(members))  # type: ignore[union-attr]
            if split:  # raised on every rank: all of them call new_group
                raise ValueError(
                    f"this subgroup ({sorted(members)}) contains some but not all ranks of the slots {split} of "
                    f"placement {pg.placement.text()!r}: co-located ranks take turns at every collective, "  # type: ignore[union-attr]
                    f"which needs them all to issue the same ones; place the job so that no group splits a slot")
            turns.suspend()  # the new group's rendezvous needs every rank of the slot at once
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            if turns is not None:
                turns.resume()

    new_group.__singularity_original__ = original  # type: ignore[attr-defined]
    return new_group


def _patched_get_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_backend(group: Any = None) -> Any:
        pg = group if group is not None else c10d._get_default_group()
        if isinstance(pg, SingularityProcessGroup):
            try:
                return dist.Backend(pg.wrapped_backend)
            except ValueError:
                return pg.wrapped_backend
        return original(group)

    get_backend.__singularity_original__ = original  # type: ignore[attr-defined]
    return get_backend


def install(reduction: Optional[str] = None) -> None:
    """Make ``init_process_group("gloo" | "nccl" | ...)`` build the singularity backend around it.

    Call once per rank process before the user's code runs (the proxy's rank entry point does).
    ``new_group(backend=...)`` is wrapped the same way, and ``dist.get_backend()`` keeps
    answering what the user asked for.  ``reduction`` overrides
    ``SINGULARITY_REDUCTION`` ("exact", the default, or "plain").
    """
    if reduction is not None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}")
        _STATE["reduction"] = reduction
    register()
    for module in (c10d, dist):
        for name, patch in (("init_process_group", _patched_init), ("new_group", _patched_new_group),
                            ("get_backend", _patched_get_backend)):
            if not hasattr(getattr(module, name), "__singularity_original__"):
                setattr(module, name, patch(getattr(module, name)))


def uninstall() -> None:
    """Undo `install` (tests); the registered backend stays available by name."""
    for module in (c10d, dist):
        for name in ("init_process_group", "new_group", "get_backend"):
            fn = getattr(module, name)
            original = getattr(fn, "__singularity_original__", None)
            if original is not None:
                setattr(module, name, original)
    _STATE.pop("reduction", None)


BACKEND_ENV = "SINGULARITY_BACKEND"


def restore_process_group(backend: Optional[str] = None) -> None:
    """Create the default group before a restore loads the namespace.

    The program's own ``init_process_group`` statement ran before the checkpoint, so a restore
    skips it, while a pickled DDP module re-attaches to the default group as it is loaded.
    ``backend`` defaults to ``SINGULARITY_BACKEND``, else what ``init_process_group(None)``
    would pick.  Rendezvous comes from the usual env:// variables.
    """
    if dist.is_initialized():
        return
    install()
    dist.init_process_group(backend or os.environ.get(BACKEND_ENV) or None)


def default_group() -> Optional[SingularityProcessGroup]:
    """The default group if it is ours (for the worker: placement, turns, drain)."""
    if not dist.is_initialized():
        return None
    pg = c10d._get_default_group()
    return pg if isinstance(pg, SingularityProcessGroup) else None
