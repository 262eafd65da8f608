"""The singularity process group in one process: W ranks as threads over gloo and a HashStore.

Fast checks of the algorithms (fixed-order reduction, placement translation, flag piggyback,
error propagation); the multi-process DDP tests are in test_collectives_ddp.py.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

from backend.proxy.distributed import exact
from backend.proxy.distributed.collectives import SingularityProcessGroup
from backend.proxy.distributed.cut import ConsistentCut
from backend.proxy.distributed.layout import RankLayout


def run_group(placement: str, fn: Callable[[SingularityProcessGroup, int], Any], reduction: str = "exact",
              cuts: Optional[list[ConsistentCut]] = None, turns: bool = False) -> list[Any]:
    """Run ``fn(pg, rank)`` on every rank of ``placement``, each rank a thread; return the results."""
    pl = RankLayout.parse(placement)
    world = pl.world_size
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            pg = SingularityProcessGroup(dist.PrefixStore("t/", store), rank, world, timedelta(seconds=30),
                                         {"cpu": "gloo"}, pl, reduction, cut=cuts[rank] if cuts else None,
                                         turns=turns)
            try:
                results[rank] = fn(pg, rank)
            finally:
                pg.shutdown()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def contribution(rank: int, n: int = 1000, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** (rank % 3)).to(dtype)


def reference(world: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed tree written out by hand (independently of exact.split)."""
    x = [contribution(r, dtype=dtype) for r in range(world)]
    if world == 2:
        return x[0] + x[1]
    if world == 3:
        return (x[0] + x[1]) + x[2]
    if world == 4:
        return (x[0] + x[1]) + (x[2] + x[3])
    if world == 6:
        return ((x[0] + x[1]) + (x[2] + x[3])) + (x[4] + x[5])
    raise AssertionError(world)


def allreduce(pg: SingularityProcessGroup, rank: int, dtype: torch.dtype = torch.float32,
              op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    t = contribution(rank, dtype=dtype)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([t], opts).wait()
    return t


# ---------------------------------------------------------------------------- the tree
@pytest.mark.parametrize("world", range(1, 10))
def test_tree_covers_ranks_in_order_and_aligned_blocks_are_subtrees(world: int) -> None:
    def leaves(node: exact.Node) -> list[int]:
        if node[1] - node[0] == 1:
            return [node[0]]
        a, b = exact.split(node)
        assert a[1] == b[0] and a[0] == node[0] and b[1] == node[1]
        return leaves(a) + leaves(b)

    assert leaves((0, world)) == list(range(world))
    size = 1
    while size <= world:
        if world % size == 0:
            for lo in range(0, world, size):
                assert exact.cover(world, range(lo, lo + size)) == [(lo, lo + size)]
        size *= 2
    members = [r for r in range(world) if r % 3 != 1]
    covered = [r for node in exact.cover(world, members) for r in range(*node)]
    assert covered == members


# ---------------------------------------------------------------------------- allreduce
@pytest.mark.parametrize("placement", ["0|1|2|3", "3|1|0|2", "0,1|2,3", "0,1,2,3", "0,2|1,3", "0,1,2|3",
                                       "0|1|2", "2,0|1", "0,1|2,3|4,5", "5,4,3|2,1,0", "1|0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exact_allreduce_is_the_fixed_tree_for_every_placement(placement: str, dtype: torch.dtype) -> None:
    world = RankLayout.parse(placement).world_size
    out = run_group(placement, lambda pg, r: allreduce(pg, r, dtype))
    expected = reference(world, dtype)
    for t in out:
        assert torch.equal(t, expected), "bits differ from the logical-rank tree"


@pytest.mark.parametrize("placement", ["3|1|0|2", "0,1|2,3", "0,2,1|3"])
def test_segmented_pipeline_gives_the_same_bits(placement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact, "SEGMENT_BYTES", 200)  # 1000 floats in many uneven segments
    out = run_group(placement, allreduce)
    for t in out:
        assert torch.equal(t, reference(4, torch.float32))


def test_plain_reduction_depends_on_placement_exact_does_not() -> None:
    """The control: gloo's own order changes with the physical ring, ours does not."""
    plain = [run_group(p, allreduce, "plain")[0] for p in ("0|1|2|3", "3|1|0|2")]
    assert not torch.equal(plain[0], plain[1])
    assert torch.allclose(plain[0], plain[1], rtol=1e-5, atol=1e-3)
    exact_ = [run_group(p, allreduce)[0] for p in ("0|1|2|3", "3|1|0|2")]
    assert torch.equal(exact_[0], exact_[1])


@pytest.mark.parametrize("placement", ["0|1|2|3", "2,3|0,1"])
def test_other_ops_and_dtypes(placement: str) -> None:
    def body(pg: SingularityProcessGroup, rank: int) -> dict:
        out = {"avg": allreduce(pg, rank, torch.float32, dist.ReduceOp.AVG),
               "max": allreduce(pg, rank, torch.float32, dist.ReduceOp.MAX),
               "min": allreduce(pg, rank, torch.float64, dist.ReduceOp.MIN)}
        ints = torch.arange(5, dtype=torch.int64) * (rank + 1)
        pg.allreduce([ints]).wait()
        out["int"] = ints
        bits = torch.tensor([1 << rank], dtype=torch.int32)
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.BOR
        pg.allreduce([bits], o).wait()
        out["bor"] = bits
        nc = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t()  # not contiguous
        pg.allreduce([nc]).wait()
        out["nc"] = nc
        empty = torch.empty(0)
        pg.allreduce([empty]).wait()
        out["empty"] = empty
        a, b = torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank)
        pg.allreduce_coalesced([a, b]).wait()
        out["coalesced"] = (a, b)
        return out

    out = run_group(placement, body)
    xs = [contribution(r) for r in range(4)]
    for o in out:
        assert torch.equal(o["avg"], reference(4, torch.float32) / 4)
        assert torch.equal(o["max"], torch.stack(xs).max(0).values)
        assert torch.equal(o["min"], torch.stack([contribution(r, dtype=torch.float64) for r in range(4)]).min(0).values)
        assert o["int"].tolist() == [0, 10, 20, 30, 40]
        assert o["bor"].item() == 0b1111
        assert torch.equal(o["nc"], torch.arange(12.0).reshape(3, 4).t() * 10)
        assert o["empty"].numel() == 0
        assert o["coalesced"][0].tolist() == [6.0] * 3 and o["coalesced"][1].tolist() == [[12.0] * 2] * 2


def test_data_movement_uses_logical_ranks() -> None:
    """Broadcast roots, allgather order, alltoall and reduce-scatter are logical under a permutation."""
    def body(pg: SingularityProcessGroup, rank: int) -> dict:
        out: dict = {}
        t = torch.full((3,), float(rank))
        o = dist.BroadcastOptions()
        o.rootRank = 2
        pg.broadcast([t], o).wait()
        out["bcast"] = t
        outs = [torch.empty(2) for _ in range(4)]
        pg.allgather([outs], [torch.tensor([rank, 10.0 * rank])]).wait()
        out["allgather"] = outs
        flat = torch.empty(8)
        pg._allgather_base(flat, torch.tensor([rank, -rank], dtype=torch.float32)).wait()
        out["allgather_base"] = flat
        send = torch.arange(4, dtype=torch.float32) + 100 * rank  # element j goes to rank j
        recv = torch.empty(4)
        pg.alltoall_base(recv, send, [], []).wait()
        out["alltoall"] = recv
        rs = torch.empty(2)
        pg._reduce_scatter_base(rs, torch.arange(8, dtype=torch.float32) * (rank + 1)).wait()
        out["reduce_scatter"] = rs
        gathered = [torch.empty(1) for _ in range(4)] if rank == 1 else []
        go = dist.GatherOptions()
        go.rootRank = 1
        pg.gather([gathered] if gathered else [], [torch.tensor([float(rank)])], go).wait()
        out["gather"] = gathered
        so = dist.ScatterOptions()
        so.rootRank = 3
        piece = torch.empty(1)
        pieces = [torch.tensor([10.0 * r]) for r in range(4)] if rank == 3 else []
        pg.scatter([piece], [pieces] if pieces else [], so).wait()
        out["scatter"] = piece
        pg.barrier().wait()
        return out

    out = run_group("3,1|0,2", body)
    for rank, o in enumerate(out):
        assert o["bcast"].tolist() == [2.0] * 3
        assert [t.tolist() for t in o["allgather"]] == [[r, 10.0 * r] for r in range(4)]
        assert o["allgather_base"].tolist() == [v for r in range(4) for v in (r, -r)]
        assert o["alltoall"].tolist() == [rank + 100.0 * r for r in range(4)]
        assert o["reduce_scatter"].tolist() == [v * 10 for v in (2 * rank, 2 * rank + 1)]
        assert o["scatter"].tolist() == [10.0 * rank]
    assert [t.item() for t in out[1]["gather"]] == [0.0, 1.0, 2.0, 3.0]


def test_a_failed_collective_raises_on_wait_and_poisons_the_group() -> None:
    """torch's future-backed Work swallows errors on wait(); ours raises them."""
    def body(pg: SingularityProcessGroup, rank: int) -> list[str]:
        errors = []
        for _ in range(2):
            # an expanded tensor cannot take the result: the copy back fails inside the worker
            work = pg.allreduce([torch.zeros(1).expand(3)])
            with pytest.raises(RuntimeError) as info:
                work.wait()
            errors.append(str(info.value))
        return errors

    for errors in run_group("0|1", body):
        assert "memory location" in errors[0]
        assert "earlier collective" in errors[1]


def test_exact_rejects_what_it_cannot_do_at_issue() -> None:
    pg_errors = []

    def body(pg: SingularityProcessGroup, rank: int) -> None:
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.AVG
        with pytest.raises(ValueError, match="floating-point"):
            pg.allreduce([torch.ones(2, dtype=torch.int32)], o)
        with pytest.raises(ValueError, match="one tensor per rank"):
            pg.allreduce([torch.ones(2), torch.ones(2)])
        pg_errors.append(rank)

    run_group("0|1", body)
    assert sorted(pg_errors) == [0, 1]


# ---------------------------------------------------------------------------- flags
@pytest.mark.parametrize("placement,reduction", [("0|1|2|3", "exact"), ("1,0|3,2", "exact"), ("0|1|2|3", "plain")])
def test_request_on_one_rank_is_decided_by_all_at_the_same_step(placement: str, reduction: str) -> None:
    cuts = [ConsistentCut(every=1000) for _ in range(4)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        decisions = []
        for step in range(12):
            if rank == 2 and step == 5:
                cuts[rank].request("stop" if reduction == "exact" else "continue")
            allreduce(pg, rank)
            d = cuts[rank].poll(step)
            if d is not None:
                decisions.append((d.step, d.then))
        return decisions

    out = run_group(placement, body, reduction, cuts)
    then = "stop" if reduction == "exact" else "continue"
    assert out == [[(5, then)]] * 4
    assert all(c.ticks == 0 for c in cuts), "allreduces carried the flag: no extra exchange needed"


def _root_0() -> Any:
    o = dist.BroadcastOptions()
    o.rootRank = 0
    return o


def test_without_allreduces_the_cut_ticks_after_every_k_other_collectives() -> None:
    cuts = [ConsistentCut(every=4) for _ in range(3)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        decisions = []
        for step in range(20):
            if rank == 0 and step == 6:
                cuts[rank].request("continue")
            pg.broadcast([torch.full((4,), float(rank))], _root_0()).wait()
            d = cuts[rank].poll(step)
            if d is not None:
                decisions.append(d.step)
        return decisions

    out = run_group("0|2|1", body, cuts=cuts)
    assert out == [[7]] * 3  # ticks follow broadcasts 4, 8, ...: the first after the request is step 7's
    assert [c.ticks for c in cuts] == [5, 5, 5]


class SafePoints:
    """One rank's safe points, counted as the engine counts them (each rank its own), and where
    its cut decided to checkpoint."""

    def __init__(self, cut: ConsistentCut) -> None:
        self.cut = cut
        self.count = 0
        self.decisions: list[Any] = []

    def __call__(self, where: Any) -> None:
        self.count += 1
        if self.cut.poll(self.count) is not None:
            self.decisions.append(where)


def test_ranks_with_different_safe_points_agree_without_ticking_apart() -> None:
    """Rank 0 passes three times as many safe points as the others (a loop only it runs), and
    between small allreduces every rank runs a loop bounded by time: a tick decided by counting
    safe points would meet a different collective on another rank and hang. Collectives are
    what the ranks share; the cut counts those."""
    cuts = [ConsistentCut(every=2) for _ in range(3)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        safe_point = SafePoints(cuts[rank])
        for step in range(40):
            if rank == 1 and step == 13:
                cuts[rank].request("continue")
            deadline = time.perf_counter() + 0.002
            while time.perf_counter() < deadline or (rank == 0 and safe_point.count % 3):
                safe_point(step)
            if step % 5 == 4:
                allreduce(pg, rank)
        return safe_point.decisions

    out = run_group("0|1|2", body, cuts=cuts)
    assert out == [[15]] * 3  # the allreduce of step 14 carried the request: decided after it
    assert [c.ticks for c in cuts] == [0, 0, 0]


def test_a_rank_without_a_safe_point_between_two_collectives_is_not_cut_there() -> None:
    """Rank 1 goes from its allreduce straight to a barrier while rank 0 validates in between
    (safe points only it passes), as at the end of an epoch. Acting on the allreduce's flag at
    rank 0's next safe point would checkpoint rank 0 before the barrier and rank 1 after it, and
    each would wait for a collective the other never issues. The confirmation refuses that place;
    the cut happens after the next tick, where both wait at a safe point."""
    cuts = [ConsistentCut(every=4) for _ in range(2)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        safe_point = SafePoints(cuts[rank])
        for step in range(12):
            if rank == 1 and step == 5:
                cuts[rank].request("continue")
            allreduce(pg, rank)
            if rank == 0:
                for _ in range(3):  # validation: safe points only rank 0 passes
                    safe_point(("validation", step))
            pg.barrier().wait()
            safe_point(("loop", step))
        return safe_point.decisions

    out = run_group("0|1", body, cuts=cuts)
    assert out == [[("loop", 7)]] * 2  # the tick after the 8th barrier (step 7) carried it
    assert [c.refused for c in cuts] == [3, 3]  # the allreduces of steps 5, 6, 7 could not


def test_ranks_taking_turns_on_one_device_step_aside_while_they_confirm() -> None:
    """Ranks 0 and 1 share a device and take turns: a rank waiting at a safe point for the
    confirmation must pass its turn, or the other, waiting for the turn, never gets to its own
    safe point, and neither confirms."""
    cuts = [ConsistentCut(every=1000) for _ in range(3)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        pg.start_turns()
        safe_point = SafePoints(cuts[rank])
        for step in range(40):
            if rank == 2 and step % 10 == 3:
                cuts[rank].request("continue")
            allreduce(pg, rank)
            for _ in range(3 if rank == 0 else 1):  # rank 0 has more safe points
                safe_point(step)
        return safe_point.decisions

    out = run_group("0,1|2", body, cuts=cuts, turns=True)
    assert out[0] == out[1] == out[2] and len(out[0]) == 4, out


def test_a_phase_without_collectives_cannot_be_cut_and_the_request_waits() -> None:
    cuts = [ConsistentCut(every=1) for _ in range(2)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        decisions = []
        if rank == 0:
            cuts[rank].request("stop")
        for step in range(30):
            if cuts[rank].poll(step) is not None:
                decisions.append(step)
        pending = cuts[rank].pending_request
        allreduce(pg, rank)
        if cuts[rank].poll(30) is not None:
            decisions.append(30)
        return [decisions, pending is not None]

    assert run_group("0|1", body, cuts=cuts) == [[[30], True], [[30], False]]


def test_plain_reduction_lets_large_allreduces_go_unflagged_and_ticks_instead() -> None:
    cuts = [ConsistentCut(every=3) for _ in range(2)]

    def body(pg: SingularityProcessGroup, rank: int) -> list:
        decisions = []
        for step in range(10):
            if rank == 1 and step == 4:
                cuts[rank].request("stop")
            pg.allreduce([torch.ones(100_000)]).wait()  # 400 kB: above the plain path's flag limit
            d = cuts[rank].poll(step)
            if d is not None:
                decisions.append((d.step, d.then))
        return decisions

    assert run_group("1|0", body, "plain", cuts) == [[(5, "stop")]] * 2  # the tick after step 5's
    assert [c.ticks for c in cuts] == [3, 3]


# ---------------------------------------------------------------------------- configuration
def test_install_wraps_init_and_new_group_and_uninstall_restores() -> None:
    from backend.proxy.distributed import collectives

    original = dist.init_process_group
    collectives.install()
    try:
        assert dist.init_process_group is not original
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            pg = dist.distributed_c10d._get_default_group()
            assert isinstance(pg, SingularityProcessGroup) and pg.group_name
            assert dist.get_backend() == "gloo"
            t = torch.tensor([2.5])
            dist.all_reduce(t)
            assert t.item() == 2.5
            assert isinstance(dist.new_group(backend="gloo"), SingularityProcessGroup)
        finally:
            dist.destroy_process_group()
    finally:
        collectives.uninstall()
    assert dist.init_process_group is original


def test_backend_and_placement_parsing() -> None:
    from backend.proxy.distributed.collectives import inner_backends

    assert inner_backends("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert inner_backends(None)["cpu"] == "gloo"
    with pytest.raises(ValueError, match="mpi"):
        inner_backends("mpi")
    p = RankLayout.parse("2,0|1,3")
    assert p.order == [2, 0, 1, 3] and p.physical(1) == 2 and p.slot_of(3) == 1 and p.max_per_slot == 2
    assert p.splits([0, 1]) == [(2, 0), (1, 3)] and p.splits([0, 2]) == []
    assert p.restrict([1, 3]).slots == ((0, 1),)
    assert RankLayout.contiguous(6, 3).text() == "0,1,2|3,4,5"
    for bad in ("0,1|1", "0|2", "a|b", "0||1"):
        with pytest.raises(ValueError):
            RankLayout.parse(bad)
    with pytest.raises(ValueError, match="world size"):
        RankLayout.from_env(3, {"SINGULARITY_PLACEMENT": "0|1"})


# ---------------------------------------------------------------------------- turns
def test_turn_ring_is_exclusive_survives_suspend_and_lets_ranks_leave_early() -> None:
    from backend.proxy.distributed.splice import TurnRing

    store = dist.HashStore()
    size = 3
    lock = threading.Lock()
    active, peak, order = [0], [0], []
    rounds = {0: 4, 1: 7, 2: 7}  # rank 0 leaves first; the others must not wait for it

    def rank(i: int) -> None:
        ring = TurnRing(dist.PrefixStore("turns/", store), i, size, timedelta(seconds=20))
        ring.start()
        for r in range(rounds[i]):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
                order.append(i)
            threading.Event().wait(0.002)  # "compute"
            with lock:
                active[0] -= 1
            if r == 2:  # a subgroup creation: every rank passes through suspend/resume
                ring.suspend()
                ring.resume()
            else:
                ring.yield_turn()
        ring.leave()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "the ring deadlocked"
    assert peak[0] == 1, "two ranks of a slot computed at once"
    assert order[:6] == [0, 1, 2, 0, 1, 2], "turns go round robin in slot order"
    assert sorted(order) == sorted(i for i, n in rounds.items() for _ in range(n))
