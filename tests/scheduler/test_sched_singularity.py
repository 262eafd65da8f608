"""The Singularity policy on hand-made snapshots: tiers, costs, anti-thrash, fairness, defrag."""
from __future__ import annotations

import random

from backend.scheduler.singularity import PolicyConfig, singularity_policy
from backend.scheduler.synthetic import big_snapshot
from backend.scheduler.tiers import min_devices
from backend.scheduler.types import Migrate, Place, Preempt, Resize
from sched_helpers import B, P, S, apply, by_job, ndev, running, snapshot, waiting
from singularity_sdk.protocol import JobState

NOW = 100_000.0
HOUR = 3600.0
#: the rules before tiers shared one least-attained-service pool: each tier alone, basic jobs
#: shrinkable to one device (still available as knobs, and pinned here)
PER_TIER = PolicyConfig(las_across=False, basic_min_fraction=0.0)


def test_min_devices_per_tier():
    cfg = PolicyConfig()
    assert min_devices(P, 8, cfg) == 8
    assert min_devices(S, 8, cfg) == 4
    assert min_devices(S, 6, cfg) == 3
    assert min_devices(S, 3, cfg) == 3  # half of 3 rounds up to 2, which does not divide 3
    assert min_devices(S, 1, cfg) == 1
    assert min_devices(B, 8, cfg) == 4  # basic shrinks to half as well
    assert min_devices(B, 6, cfg) == 3
    assert min_devices(B, 8, PER_TIER) == 1


def test_premium_on_full_cluster_of_basic_shrinks_then_preempts_with_reasons():
    jobs = [
        running("b-big", B, 4, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - 100, ckpt=NOW - 50),
        running("b-1", B, 1, {"node-0": (4,)}, submitted_at=NOW - 400, ckpt=NOW - 300),
        running("b-2", B, 1, {"node-0": (5,)}, submitted_at=NOW - 300, ckpt=NOW - 10),
        running("b-3", B, 1, {"node-0": (6,)}, submitted_at=NOW - 200, ckpt=NOW - 200),
        running("b-4", B, 1, {"node-0": (7,)}, submitted_at=NOW - 100, ckpt=NOW - 100),
        waiting("p-1", P, 4, submitted_at=NOW - 5),
    ]
    snap = snapshot(NOW, {"node-0": 8}, jobs)
    actions = singularity_policy(snap, PER_TIER)
    after = apply(snap, actions)
    acts = by_job(actions)
    # cheapest first: shrink the spliceable basic job as far as it goes (4 -> 1 frees 3), then
    # preempt the basic job that loses least work (newest checkpoint: b-2)
    assert isinstance(acts["b-big"], Resize) and ndev(after["b-big"]) == 1
    assert isinstance(acts["b-2"], Preempt)
    assert set(acts) == {"b-big", "b-2", "p-1"}
    assert isinstance(acts["p-1"], Place) and ndev(after["p-1"]) == 4
    assert acts["b-2"].reason.startswith("preempted: premium job p-1 needs 4 devices on node-0")
    assert "shrunk 4->1" in acts["b-big"].reason and "p-1" in acts["b-big"].reason
    # victims' actions come before the placement that uses their devices
    assert [type(a) for a in actions][-1] is Place


def test_standard_is_never_shrunk_below_half_and_preempted_only_for_premium():
    std = running("s-8", S, 8, {"node-0": tuple(range(8))}, user="a", submitted_at=NOW - HOUR)
    # a small premium job: the standard job shrinks to 4 (its minimum divisor >= half), not 6 or 7
    snap = snapshot(NOW, {"node-0": 8}, [std, waiting("p-2", P, 2, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    after = apply(snap, list(acts.values()))
    assert isinstance(acts["s-8"], Resize) and ndev(after["s-8"]) == 4
    assert ndev(after["p-2"]) == 2
    # a premium job that needs more than shrinking gives: the standard job is preempted
    snap = snapshot(NOW, {"node-0": 8}, [std, waiting("p-6", P, 6, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    assert isinstance(acts["s-8"], Preempt)
    assert "premium job p-6" in acts["s-8"].reason
    # a standard job of another user, holding less, may shrink it to half but never preempt it
    snap = snapshot(NOW, {"node-0": 8}, [std, waiting("s-6", S, 6, user="b", submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    after = apply(snap, list(acts.values()))
    assert isinstance(acts["s-8"], Resize) and ndev(after["s-8"]) == 4
    assert ndev(after["s-6"]) == 3 and "fair share" in acts["s-8"].reason
    # standard 1-device jobs cannot shrink: another standard job waits, nobody is preempted
    ones = [running(f"s1-{i}", S, 1, {"node-0": (i,)}, user="a", submitted_at=NOW - HOUR) for i in range(8)]
    snap = snapshot(NOW, {"node-0": 8}, ones + [waiting("s-w", S, 1, user="b", submitted_at=NOW)])
    assert singularity_policy(snap) == []


def test_premium_is_never_touched():
    prem = [running(f"p-{i}", P, 2, {"node-0": (2 * i, 2 * i + 1)}, submitted_at=NOW - HOUR) for i in range(4)]
    for arriving in (waiting("p-new", P, 4, submitted_at=NOW), waiting("s-new", S, 8, submitted_at=NOW)):
        snap = snapshot(NOW, {"node-0": 8, "node-1": 8}, prem + [arriving])
        actions = singularity_policy(snap)
        assert all(not a.job_id.startswith("p-") or a.job_id == "p-new" for a in actions)
    # even a shrunk premium job (resized by an operator) is only ever grown, never shrunk
    shrunk = running("p-s", P, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [shrunk, waiting("p-x", P, 4, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    assert set(acts) == {"p-x"}


def test_anti_thrash_leaves_recently_moved_jobs_alone():
    cfg = PolicyConfig(min_move_interval_s=600)
    for moved_ago, touched in ((10.0, False), (599.0, False), (700.0, True)):
        basic = running("b", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - HOUR, moved=NOW - moved_ago)
        snap = snapshot(NOW, {"node-0": 8}, [basic, waiting("p", P, 8, submitted_at=NOW)])
        acts = by_job(singularity_policy(snap, cfg))
        assert ("b" in acts) is touched
        assert ("p" in acts) is touched
    # nor does a protected shrunk job grow back yet
    shrunk = running("s", S, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - HOUR, moved=NOW - 60)
    assert singularity_policy(snapshot(NOW, {"node-0": 8}, [shrunk]), cfg) == []


def test_jobs_in_transition_are_left_alone():
    moving = running("b", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - HOUR, state=JobState.MIGRATING)
    snap = snapshot(NOW, {"node-0": 8}, [moving, waiting("p", P, 8, submitted_at=NOW)])
    assert singularity_policy(snap) == []


def test_fair_share_between_two_users_in_a_tier():
    a = [waiting(f"a-{i}", S, 1, user="a", submitted_at=NOW - 100 + i) for i in range(8)]
    b = [waiting(f"b-{i}", S, 1, user="b", submitted_at=NOW - 50 + i) for i in range(4)]
    snap = snapshot(NOW, {"node-0": 8}, a + b)
    placed = [x.job_id for x in singularity_policy(snap)]
    assert sorted(placed) == ["a-0", "a-1", "a-2", "a-3", "b-0", "b-1", "b-2", "b-3"]
    # a user already holding devices goes after one who holds none, even if it submitted first
    held = [running(f"a-r{i}", S, 1, {"node-0": (i,)}, user="a", submitted_at=NOW - HOUR) for i in range(6)]
    snap = snapshot(NOW, {"node-0": 8}, held + a[:2] + b[:2])
    placed = [x.job_id for x in singularity_policy(snap)]
    assert placed == ["b-0", "b-1"]


def test_queue_order_premium_standard_basic_fifo():
    jobs = [
        waiting("b-old", B, 1, submitted_at=NOW - 300),
        waiting("s-mid", S, 1, submitted_at=NOW - 200),
        waiting("p-new", P, 1, submitted_at=NOW - 100),
        waiting("p-newer", P, 1, submitted_at=NOW - 50),
    ]
    blocker = running("x", P, 6, {"node-0": tuple(range(6))}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [blocker] + jobs)
    assert [a.job_id for a in singularity_policy(snap)] == ["p-new", "p-newer"]
    snap = snapshot(NOW, {"node-0": 8}, [blocker] + jobs[:2] + [waiting("p-x", P, 1, submitted_at=NOW)])
    assert [a.job_id for a in singularity_policy(snap)] == ["p-x", "s-mid"]


def test_defragmentation_migrates_small_jobs_so_a_large_job_fits():
    small = [
        running("s-a", S, 1, {"node-0": (0,)}, user="x", submitted_at=NOW - HOUR),
        running("s-b", S, 1, {"node-0": (1,)}, user="x", submitted_at=NOW - HOUR),
        running("s-c", S, 1, {"node-1": (0,)}, user="x", submitted_at=NOW - HOUR),
        running("s-d", S, 1, {"node-1": (1,)}, user="x", submitted_at=NOW - HOUR),
    ]
    snap = snapshot(NOW, {"node-0": 4, "node-1": 4}, small + [waiting("big", P, 4, user="y", submitted_at=NOW)])
    actions = singularity_policy(snap)
    after = apply(snap, actions)
    kinds = sorted(type(a).__name__ for a in actions)
    assert kinds == ["Migrate", "Migrate", "Place"]
    (node,) = after["big"]
    assert len(after["big"][node]) == 4
    assert all(node not in after[j] for j in ("s-a", "s-b", "s-c", "s-d"))
    assert all("defragmentation" in a.reason for a in actions if isinstance(a, Migrate))
    # young jobs: moving them costs more than the wait it saves, so a standard job starts shrunk
    young = [running(j.id, S, 1, j.placement, user="x", submitted_at=NOW - 5) for j in small]
    snap = snapshot(NOW, {"node-0": 4, "node-1": 4}, young + [waiting("big", S, 4, user="y", submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    assert set(acts) == {"big"} and ndev(acts["big"].placement) == 2


def test_work_conservation_grows_shrunk_jobs_and_starts_jobs_shrunk():
    shrunk = running("s", S, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)
    acts = by_job(singularity_policy(snapshot(NOW, {"node-0": 8}, [shrunk])))
    assert isinstance(acts["s"], Resize) and ndev(acts["s"].placement) == 8
    assert "grown 4->8" in acts["s"].reason
    # waiting work comes first: the idle devices go to the queued job, the shrunk one stays
    snap = snapshot(NOW, {"node-0": 8}, [shrunk, waiting("q", S, 4, submitted_at=NOW)])
    assert set(by_job(singularity_policy(snap))) == {"q"}
    # a basic job starts on whatever is spare, shrunk (to half at most), rather than wait
    blocker = running("x", P, 4, {"node-0": tuple(range(4))}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [blocker, waiting("b", B, 8, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap))
    assert ndev(acts["b"].placement) == 4 and "splicing factor 2" in acts["b"].reason
    blocker = running("x", P, 6, {"node-0": tuple(range(6))}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [blocker, waiting("b", B, 8, submitted_at=NOW)])
    assert singularity_policy(snap) == [] and set(by_job(singularity_policy(snap, PER_TIER))) == {"b"}
    # growth that cannot pay for its stall is not done (job only 10 s old)
    young = running("s", S, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - 10)
    assert singularity_policy(snapshot(NOW, {"node-0": 8}, [young])) == []


def test_aging_lets_an_old_basic_job_take_devices_from_young_basic_jobs():
    cfg = PolicyConfig(aging_horizon_s=4 * HOUR, las_across=False, basic_min_fraction=0.0)
    young = [running(f"b-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - 60) for i in range(8)]
    snap = snapshot(NOW, {"node-0": 8}, young + [waiting("b-old", B, 1, submitted_at=NOW - 5 * HOUR)])
    acts = by_job(singularity_policy(snap, cfg))
    assert isinstance(acts["b-old"], Place) and "aged past 4 h" in acts["b-old"].reason
    assert sum(isinstance(a, Preempt) for a in acts.values()) == 1
    snap = snapshot(NOW, {"node-0": 8}, young + [waiting("b-new", B, 1, submitted_at=NOW - 1 * HOUR)])
    assert singularity_policy(snap, cfg) == []
    # an aged basic job may still start small on spare devices (basic's freedom), and once
    # running it is protected like a standard job: shrunk to half at most
    blocker = running("x", P, 6, {"node-0": tuple(range(6))}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [blocker, waiting("b-old", B, 8, submitted_at=NOW - 5 * HOUR)])
    acts = by_job(singularity_policy(snap, cfg))
    assert ndev(acts["b-old"].placement) == 2
    old8 = running("b-old", B, 8, {"node-0": tuple(range(8))}, submitted_at=NOW - 5 * HOUR)
    snap = snapshot(NOW, {"node-0": 8}, [old8, waiting("p", P, 2, submitted_at=NOW)])
    acts = by_job(singularity_policy(snap, cfg))
    assert ndev(acts["b-old"].placement) == 4


def test_preempted_jobs_resume_in_submit_order():
    jobs = [
        waiting("q-late", S, 1, submitted_at=NOW - 10),
        waiting("pre-early", S, 1, submitted_at=NOW - 100, state=JobState.PREEMPTED),
    ]
    blocker = running("x", P, 7, {"node-0": tuple(range(7))}, submitted_at=NOW - HOUR)
    acts = singularity_policy(snapshot(NOW, {"node-0": 8}, [blocker] + jobs))
    assert [a.job_id for a in acts] == ["pre-early"] and acts[0].reason.startswith("resumed on node-0")


def test_multi_node_premium_job_takes_whole_nodes():
    jobs = [running(f"b-{n}", B, 8, {f"node-{n}": tuple(range(8))}, submitted_at=NOW - HOUR) for n in range(3)]
    snap = snapshot(NOW, {f"node-{n}": 8 for n in range(3)}, jobs + [waiting("p16", P, 16, submitted_at=NOW)])
    actions = singularity_policy(snap)
    after = apply(snap, actions)
    assert ndev(after["p16"]) == 16 and all(len(d) == 8 for d in after["p16"].values())
    assert len([a for a in actions if isinstance(a, Preempt)]) == 2


def test_policy_is_pure_and_deterministic():
    snap = big_snapshot(n_jobs=600, n_nodes=40, seed=3)
    before = repr(snap)
    assert singularity_policy(snap) == singularity_policy(snap)
    assert repr(snap) == before


def test_random_snapshots_keep_every_invariant():
    """Random small clusters: no double booking, tier limits and anti-thrash always hold."""
    for cfg in (PolicyConfig(), PER_TIER):
        _check_random_snapshots(cfg)


def _check_random_snapshots(cfg: PolicyConfig) -> None:
    rng = random.Random(7)
    for trial in range(150):
        snap = big_snapshot(n_jobs=rng.randint(5, 80), n_nodes=rng.randint(1, 6), per_node=rng.choice([4, 8]),
                            seed=trial, fill=rng.uniform(0.5, 1.0))
        actions = singularity_policy(snap, cfg)
        after = apply(snap, actions)
        views = {j.id: j for j in snap.jobs}
        premium_placed = any(isinstance(a, Place) and views[a.job_id].sla == P for a in actions)
        for a in actions:
            j = views[a.job_id]
            interval = cfg.min_move_interval_s
            if cfg.long_move_interval_s is not None and j.attained_s >= cfg.long_move_after_s:
                interval = cfg.long_move_interval_s  # the top service class is protected less long
            moved = j.last_moved_at is not None and snap.now - j.last_moved_at < interval
            waited = snap.now - j.submitted_at - (j.ran_s or 0.0)
            standard = j.sla == S or (j.sla == B and waited >= cfg.aging_horizon_s)
            if isinstance(a, Preempt) and standard and not cfg.las_across:
                assert premium_placed, a  # standard work is preempted only for premium work
            if isinstance(a, Preempt) and standard and not premium_placed:
                # in one pool, a standard job is preempted for other work only by far less service
                assert j.attained_s >= cfg.las_thresholds_s[cfg.las_take_gap - 1], a
            if isinstance(a, (Preempt, Migrate)) or (isinstance(a, Resize) and ndev(after[j.id]) < j.placed_devices):
                assert j.sla != P, a
                assert not moved, a
            if isinstance(a, Resize):
                assert not moved, a
            if isinstance(a, Place):
                assert ndev(after[j.id]) >= min_devices(j.sla, j.gpus, cfg), a
            if isinstance(a, Resize) and ndev(after[j.id]) < j.placed_devices:
                aged = snap.now - j.submitted_at - (j.ran_s or 0.0) >= cfg.aging_horizon_s  # waited that long
                tier = S if j.sla == B and aged else j.sla
                assert ndev(after[j.id]) >= min_devices(tier, j.gpus, cfg), a


def test_round_with_10000_jobs_on_1000_nodes_is_valid():
    # its speed is measured in bench/simulate.py, beside a Tiresias round on the same snapshot
    snap = big_snapshot(n_jobs=10_000, n_nodes=1_000)
    actions = singularity_policy(snap)
    apply(snap, actions)
    views = {j.id: j for j in snap.jobs}
    assert any(isinstance(a, Place) for a in actions)
    assert all(views[a.job_id].sla != P for a in actions if isinstance(a, Preempt))


def test_unschedulable_nodes_get_no_new_work():
    from backend.scheduler.types import NodeView, Snapshot

    shrunk = running("s", S, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)
    nodes = (NodeView("node-0", tuple(range(8)), used={d: "s" for d in range(4)}, schedulable=False),
             NodeView("node-1", tuple(range(8))))
    snap = Snapshot(now=NOW, nodes=nodes, jobs=(shrunk, waiting("q", S, 2, submitted_at=NOW)))
    actions = singularity_policy(snap)
    for a in actions:
        assert "node-0" not in getattr(a, "placement", {}), a
    acts = by_job(actions)
    # the queued job goes to node-1, leaving 6 devices: too few for the shrunk job to grow to 8
    assert set(acts) == {"q"} and set(acts["q"].placement) == {"node-1"}
    # alone, the shrunk job grows by moving to node-1 (its own node is draining)
    acts = by_job(singularity_policy(Snapshot(now=NOW, nodes=nodes, jobs=(shrunk,))))
    assert isinstance(acts["s"], Resize) and acts["s"].placement == {"node-1": tuple(range(8))}


def test_victims_displaced_by_premium_resume_on_spare_devices_elsewhere():
    basics = [running(f"b-{i}", B, 1, {"node-0": (i,)}, submitted_at=NOW - HOUR) for i in range(8)]
    other = running("p-x", P, 5, {"node-1": (0, 1, 2, 3, 4)}, submitted_at=NOW - HOUR)
    snap = snapshot(NOW, {"node-0": 8, "node-1": 8}, basics + [other, waiting("p8", P, 8, submitted_at=NOW)])
    actions = singularity_policy(snap)
    after = apply(snap, actions)
    assert after["p8"] == {"node-0": tuple(range(8))}
    preempted = [a.job_id for a in actions if isinstance(a, Preempt)]
    resumed = [a for a in actions if isinstance(a, Place) and a.job_id != "p8"]
    # all eight yield node-0; three of them fit on node-1's spare devices and resume there
    assert len(preempted) == 8 and len(resumed) == 3
    assert all(set(a.placement) == {"node-1"} and "displaced" in a.reason for a in resumed)
    assert actions.index(next(a for a in actions if a.job_id == "p8")) < actions.index(resumed[0])



def test_the_policy_object_reads_again_what_the_last_round_changed_or_demoted():
    # SingularityPolicy takes over last round's untouched waiting jobs; a job that round placed
    # (its actions not applied: the same views come back) or read under a quota is read afresh
    from dataclasses import replace

    from backend.scheduler.singularity import SingularityPolicy

    cfg = PolicyConfig(basic_min_fraction=0.0)
    jobs = [
        running("s-run", S, 4, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - HOUR),
        # over a standard quota it runs as basic, aged back to standard, but may start on 2
        waiting("s-old", S, 8, user="a", submitted_at=NOW - 5 * HOUR),
        waiting("p-1", P, 4, user="b", submitted_at=NOW - 60),
    ]
    snap = snapshot(NOW, {"node-0": 4, "node-1": 2, "node-2": 4}, jobs)
    quota = replace(snap, quotas={("a", "standard"): 0})
    policy = SingularityPolicy(cfg)
    for s in (snap, snap, quota, snap, replace(snap, now=NOW + 600)):
        assert policy(s) == singularity_policy(s, cfg)
    assert by_job(policy(quota))["s-old"].placement == {"node-1": (0, 1)}
