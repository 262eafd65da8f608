"""A shrunk job grows back by migrating smaller jobs when no node has room (``defrag_grow``).

Without it a job shrunk to half in a rush stays at half speed for as long as small jobs keep
every node partly used, though the cluster has devices idle: the wrong policy
(``defrag_grow=False``) leaves it there, and each test runs it to tell the difference.
"""
from __future__ import annotations

from backend.scheduler.singularity import PolicyConfig, singularity_policy
from backend.scheduler.types import Migrate, Resize
from sched_helpers import B, P, S, apply, by_job, ndev, running, snapshot, waiting

NOW = 1_000_000.0
HOUR = 3600.0
RULE = PolicyConfig()
WRONG = PolicyConfig(defrag_grow=False)


def _small(prefix: str, sla, node: str, devs, age_h: float = 1.0):
    return [running(f"{prefix}-{d}", sla, 1, {node: (d,)}, submitted_at=NOW - age_h * HOUR,
                    attained=age_h * HOUR, ran=age_h * HOUR) for d in devs]


def test_a_shrunk_job_grows_on_its_node_once_small_jobs_move_off_it():
    wide = running("b-8", B, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - 5 * HOUR, attained=20 * HOUR,
                   ran=5 * HOUR)
    jobs = [wide] + _small("s", B, "node-0", range(4, 8))
    jobs += [running("p-4", P, 4, {"node-1": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)]  # node-1: 4 free
    snap = snapshot(NOW, {"node-0": 8, "node-1": 8}, jobs)
    actions = singularity_policy(snap, RULE)
    after = apply(snap, actions)
    acts = by_job(actions)
    assert isinstance(acts["b-8"], Resize) and after["b-8"] == {"node-0": tuple(range(8))}
    assert all(isinstance(acts[f"s-{d}"], Migrate) and set(after[f"s-{d}"]) == {"node-1"} for d in range(4, 8))
    assert "defragmentation" in acts["b-8"].reason
    # the migrations come before the growth that uses their devices
    assert [type(a) for a in actions][-1] is Resize
    assert singularity_policy(snap, WRONG) == []


def test_a_job_on_whole_nodes_grows_onto_one_more_node_freed_for_it():
    wide = running("b-16", B, 16, {"node-0": tuple(range(8))}, submitted_at=NOW - 5 * HOUR,
                   attained=40 * HOUR, ran=5 * HOUR)
    jobs = [wide] + _small("s", B, "node-1", range(4))
    jobs += [running("p-4", P, 4, {"node-2": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)]
    snap = snapshot(NOW, {"node-0": 8, "node-1": 8, "node-2": 8}, jobs)
    after = apply(snap, singularity_policy(snap, RULE))
    assert ndev(after["b-16"]) == 16 and set(after["b-16"]) == {"node-0", "node-1"}
    assert all(set(after[f"s-{d}"]) == {"node-2"} for d in range(4))
    assert singularity_policy(snap, WRONG) == []


def test_no_migration_to_grow_while_a_job_waits_or_for_a_lower_tier():
    wide = running("b-8", B, 8, {"node-0": (0, 1, 2, 3)}, submitted_at=NOW - 5 * HOUR, attained=20 * HOUR,
                   ran=5 * HOUR)
    base = [wide, running("p-4", P, 4, {"node-1": (0, 1, 2, 3)}, submitted_at=NOW - HOUR)]
    # a 8-device premium job waits (it fits nowhere, and nothing may be taken on node-1): the
    # idle devices are its to wait for, so nothing moves to grow the basic job
    blocked = base + _small("s", B, "node-0", range(4, 8)) + [waiting("p-8", P, 8, submitted_at=NOW - 60)]
    snap = snapshot(NOW, {"node-0": 8, "node-1": 8}, blocked)
    assert not any(isinstance(a, Resize) and a.job_id == "b-8" for a in singularity_policy(snap, RULE))
    # standard jobs are not moved for a basic job (migrated only for their own tier or higher)
    snap = snapshot(NOW, {"node-0": 8, "node-1": 8}, base + _small("s", S, "node-0", range(4, 8)))
    assert singularity_policy(snap, RULE) == []
