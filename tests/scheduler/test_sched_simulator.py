"""The trace simulator: hand-checkable JCTs, the cost model, conservation, CLI, a real slice."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.scheduler.simulator import InvalidAction, Simulator, main, make_policy, per_user_quotas, simulate
from backend.scheduler.trace import TraceJob, assign_tiers, load_trace
from backend.scheduler.types import Place
from singularity_sdk.protocol import SLA, JobState

PHILLY = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "philly-2017-11-06-week.csv"
P, S, B = SLA.PREMIUM, SLA.STANDARD, SLA.BASIC


def job(i: int, submit: float, duration: float, gpus: int = 1, sla: SLA = S, user: str = "u") -> TraceJob:
    return TraceJob(f"j-{i}", submit, duration, gpus, user, sla)


def run(jobs, policy: str, gpus: int, per_node: int = 8, overhead: float = 30.0):
    sim = Simulator(jobs, gpus, per_node, overhead, policy_name=policy)
    sim.set_policy(make_policy(policy, sim, overhead))
    report = sim.run()
    jct = {f"j-{i}": None for i in range(len(jobs))}
    for j in sim.jobs.values():
        jct[j.id] = j.finish - j.submit
    return report, jct, sim


@pytest.mark.parametrize("policy", ["singularity", "fifo", "fifo-backfill", "tiresias", "srtf", "srtf-premium"])
def test_one_job_alone_takes_its_duration(policy):
    report, jct, _ = run([job(0, 100.0, 3600.0, gpus=4)], policy, gpus=8)
    assert jct["j-0"] == pytest.approx(3600.0)
    assert report.queueing["mean"] == 0.0
    assert report.makespan_s == pytest.approx(3600.0)
    assert report.util_allocated == pytest.approx(0.5)
    assert report.guarantee["standard"] == pytest.approx(1.0)


def test_two_one_gpu_jobs_on_one_gpu_fifo():
    report, jct, _ = run([job(0, 0.0, 100.0), job(1, 10.0, 50.0)], "fifo", gpus=1)
    assert jct == {"j-0": pytest.approx(100.0), "j-1": pytest.approx(140.0)}  # waits 90 s, runs 50 s
    assert report.queueing["mean"] == pytest.approx(45.0)
    assert report.makespan_s == pytest.approx(150.0)
    assert report.util_allocated == pytest.approx(1.0)
    assert report.util_window == pytest.approx(1.0)  # busy over the arrival window [0, 10]
    assert report.guarantee["standard"] == pytest.approx(150.0 / 240.0)


def test_srtf_preemption_pays_overhead_on_resume():
    report, jct, _ = run([job(0, 0.0, 1000.0), job(1, 10.0, 100.0)], "srtf", gpus=1, overhead=30.0)
    # j-1 preempts j-0 at t=10 and ends at 110; j-0 resumes at 110, stalls 30 s, has 990 s left
    assert jct["j-1"] == pytest.approx(100.0)
    assert jct["j-0"] == pytest.approx(110.0 + 30.0 + 990.0)
    assert report.preemptions == 1
    assert report.overhead_gpu_hours == pytest.approx(30.0 / 3600.0)
    assert report.util_useful == pytest.approx(1100.0 / 1130.0)


def test_spliced_job_runs_at_p_over_w_and_grows_back_after_a_stall():
    # 2 devices; a premium 1-device job takes one, a basic 2-device job starts spliced on the other
    jobs = [job(0, 0.0, 100.0, gpus=1, sla=P), job(1, 0.0, 1000.0, gpus=2, sla=B)]
    report, jct, _ = run(jobs, "singularity", gpus=2, overhead=30.0)
    # j-1 does 100 s at half speed (50 s of work), then grows: 30 s stall, 950 s at full speed
    assert jct["j-0"] == pytest.approx(100.0)
    assert jct["j-1"] == pytest.approx(100.0 + 30.0 + 950.0)
    assert report.resizes == 1 and report.preemptions == 0
    assert report.overhead_gpu_hours == pytest.approx(2 * 30.0 / 3600.0)


def test_premium_arrival_shrinks_a_standard_job_in_the_simulator():
    jobs = [job(0, 0.0, 1000.0, gpus=8, sla=S), job(1, 100.0, 200.0, gpus=4, sla=P)]
    report, jct, sim = run(jobs, "singularity", gpus=8, overhead=30.0)
    assert jct["j-1"] == pytest.approx(200.0)
    # j-0: 100 s at full size (900 s of work left); shrunk to 4 at t=100, stalls to 130; half
    # speed to 300 (85 s of work); the anti-thrash interval (600 s) keeps it shrunk until the
    # wake-up at t=720 (the 60 s grid after 100 + 600): 210 s more work, 605 left; it grows,
    # stalls 30 s and finishes at 750 + 605
    assert report.resizes == 2
    assert report.guarantee["premium"] == pytest.approx(1.0)
    assert jct["j-0"] == pytest.approx(1355.0)
    assert [e for e in sim.jobs["j-0"].placement] == []  # finished jobs hold nothing



def test_a_premium_quota_makes_the_job_beyond_it_wait_as_standard_work():
    # one user, 8 devices: a standard job of 8 runs; a long premium job of 4 shrinks it to 4 at
    # t=100; at t=750 (the standard job no longer protected, under 1 device-hour of service)
    # another premium job of 4 arrives. Unbounded, it preempts the standard job and runs at
    # once. With a premium quota of half the cluster (4 devices, held by the first), it runs as
    # standard work, which may take nothing from a job of its own user with so little service.
    jobs = [job(0, 0.0, 5000.0, gpus=8, sla=S), job(1, 100.0, 3000.0, gpus=4, sla=P), job(2, 750.0, 200.0, gpus=4, sla=P)]
    free, jct_free, _ = run(jobs, "singularity", gpus=8)
    assert jct_free["j-1"] == pytest.approx(3000.0) and jct_free["j-2"] == pytest.approx(200.0)
    assert free.guarantee["premium"] == pytest.approx(1.0)
    quotas = per_user_quotas(jobs, 8, {"premium": 0.5})
    assert quotas == {("u", "premium"): 4}
    sim = Simulator(jobs, 8, 8, 30.0, policy_name="singularity", quotas=quotas)
    sim.set_policy(make_policy("singularity", sim, 30.0))
    bounded = sim.run()
    assert sim.jobs["j-1"].finish - 100.0 == pytest.approx(3000.0)
    assert sim.jobs["j-2"].finish - 750.0 > 200.0
    assert bounded.guarantee["premium"] < 1.0


def test_cli_tier_quota_is_checked_and_listed():
    with pytest.raises(SystemExit):
        main([str(PHILLY), "--tier-quota", "basic=0.1"])
    with pytest.raises(SystemExit):
        main([str(PHILLY), "--tier-quota", "premium=0"])

def test_conservation_is_enforced_against_a_buggy_policy():
    def double_book(snapshot):
        return [Place(j.id, {"node-0": (0,)}, reason="bug") for j in snapshot.jobs if j.state == JobState.QUEUED]

    sim = Simulator([job(0, 0.0, 10.0), job(1, 0.0, 10.0)], 2, 2, 0.0, policy=double_book)
    with pytest.raises(InvalidAction, match="held by j-0"):
        sim.run()

    def wrong_size(snapshot):
        return [Place(j.id, {"node-0": (0, 1, 2)}, reason="bug") for j in snapshot.jobs if j.state == JobState.QUEUED]

    with pytest.raises(InvalidAction, match="divide"):
        Simulator([job(0, 0.0, 10.0, gpus=4)], 4, 4, 0.0, policy=wrong_size).run()


def test_jobs_larger_than_the_cluster_are_left_out_and_reported():
    report, _, _ = run([job(0, 0.0, 10.0, gpus=16), job(1, 0.0, 10.0)], "fifo", gpus=8)
    assert report.rejected == 1 and report.jobs == 1


def test_tier_assignment_is_seeded_and_close_to_the_mix():
    a = assign_tiers(10_000, seed=1)
    assert a == assign_tiers(10_000, seed=1) and a != assign_tiers(10_000, seed=2)
    share = {t: a.count(t) / len(a) for t in (P, S, B)}
    assert abs(share[P] - 0.2) < 0.02 and abs(share[S] - 0.5) < 0.02 and abs(share[B] - 0.3) < 0.02
    assert assign_tiers(100, seed=1) == a[:100]  # a slice of a trace keeps its tiers


def test_cli_prints_a_table_and_json(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("submit_s,duration_s,num_gpus,vc\n0,100,1,a\n10,50,1,b\n20,200,2,a\n")
    assert main([str(trace), "--gpus", "2", "--gpus-per-node", "2", "--policy", "fifo", "--overhead-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "policy fifo: 3 jobs on 2 GPUs" in out and "tier guarantee" in out
    assert main([str(trace), "--gpus", "2", "--policy", "tiresias", "--seed", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"] == "tiresias" and data["jobs"] == 3 and data["seed"] == 3
    with pytest.raises(SystemExit):
        main([str(trace), "--policy", "nope"])


@pytest.mark.skipif(not PHILLY.exists(), reason="Philly trace not present")
def test_real_trace_slice_all_policies():
    jobs = load_trace(PHILLY, seed=0, limit=400)
    reports = {p: simulate(jobs, p, gpus=64, overhead_s=30.0) for p in ("singularity", "tiresias", "fifo")}
    work = sum(j.gpus * j.duration for j in jobs)
    for r in reports.values():
        assert r.jobs == 400
        assert 0 < r.util_useful <= r.util_allocated <= 1.0
        assert r.util_useful * r.gpus * r.makespan_s == pytest.approx(work, rel=1e-6)
        assert r.jct["mean"] >= sum(j.duration for j in jobs) / len(jobs) - 1e-6
    s = reports["singularity"]
    assert s.guarantee["premium"] >= 0.99
    assert s.jct["mean"] < reports["fifo"].jct["mean"]
    assert reports["fifo"].preemptions == 0 and s.preemptions + s.resizes > 0


def test_moves_without_overhead_leave_jobs_running():
    # with X = 0 a resized job must not stay in RESIZING (it would be untouchable for ever)
    jobs = [job(0, 0.0, 1000.0, gpus=8, sla=S), job(1, 100.0, 200.0, gpus=4, sla=P)]
    report, jct, sim = run(jobs, "singularity", gpus=8, overhead=0.0)
    assert report.resizes == 2 and report.overhead_gpu_hours == 0.0
    # 100 s full, 200 s at half (100 s of work), protected until the wake-up at 720 s:
    # 420 s more at half (210 s), grows at 720 with 590 s of work left
    assert jct["j-0"] == pytest.approx(720.0 + 590.0)


def test_simulator_views_equal_views_built_the_ordinary_way():
    # the simulator builds running jobs' views without JobView.__init__ (speed): same fields
    from dataclasses import fields

    from backend.scheduler.types import JobView

    seen = []
    inner = make_policy("fifo", None, 30.0)

    def policy(snap):
        seen.extend(j for j in snap.jobs if j.state == JobState.RUNNING)
        return inner(snap)

    Simulator([job(0, 0.0, 1000.0, gpus=2), job(1, 100.0, 10.0, gpus=2)], 2, 2, 30.0, policy=policy).run()
    v = seen[0]
    ordinary = JobView(**{f.name: getattr(v, f.name) for f in fields(JobView)})
    assert v == ordinary and vars(v).keys() == vars(ordinary).keys()
    assert v.attained_s == pytest.approx(200.0) and v.ran_s == pytest.approx(100.0)


def test_cli_runs_several_policies_with_a_progress_bar_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.csv"
    trace.write_text("submit_s,duration_s,num_gpus,vc\n0,3600,1,a\n10,7200,4,b\n20,600,2,a\n30,100,1,c\n400,5000,8,b\n")
    png = tmp_path / "out.png"
    args = [str(trace), "--gpus", "8", "--policy", "singularity,tiresias", "--plot", str(png), "--progress"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "policy singularity: 5 jobs" in captured.out and "policy tiresias: 5 jobs" in captured.out
    assert "100% 5/5 jobs done" in captured.err  # the bar ends full
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert main([str(trace), "--gpus", "8", "--policy", "fifo,srtf", "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert [r["policy"] for r in json.loads(captured.out)] == ["fifo", "srtf"] and captured.err == ""


def test_occupancy_follows_the_devices_each_tier_holds():
    jobs = [job(0, 0.0, 100.0, gpus=2, sla=P), job(1, 0.0, 300.0, gpus=4, sla=B), job(2, 50.0, 100.0, gpus=1, sla=S)]
    _, _, sim = run(jobs, "fifo", gpus=8)
    assert sim.occupancy == [(0.0, 2, 0, 4), (50.0, 2, 1, 4), (100.0, 0, 1, 4), (150.0, 0, 0, 4), (300.0, 0, 0, 0)]


def test_a_round_decides_the_same_in_every_process():
    """String hashing differs from one process to the next (PYTHONHASHSEED): no choice of the
    policy may depend on it, or the same simulation prints different figures each time. Here a
    job spread over eight nodes is preempted; which node then counts as the best fit for a
    whole-node job must not depend on the order a set of node names happens to iterate in."""
    import os
    import subprocess
    import sys

    code = (
        "from backend.scheduler.round_state import RoundState;"
        "from backend.scheduler.tiers import PolicyConfig;"
        "from sched_helpers import B, running, snapshot;"
        "names = [f'node-{c}' for c in 'qwertyui'];"
        "j = running('wide', B, 8, {n: (0,) for n in names}, submitted_at=0.0);"
        "st = RoundState(snapshot(100.0, {n: 8 for n in names}, [j]), PolicyConfig());"
        "st.preempt(st.jobs['wide'], 'test');"
        "print(st.free.best_fit(8), list(st.free.buckets[8]))"
    )
    root = Path(__file__).resolve().parents[2]
    outs = set()
    for seed in ("1", "2", "3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests" / "scheduler")]))
        res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout)
    assert len(outs) == 1, outs
    assert outs.pop().startswith("node-q ")  # the placement's own order


@pytest.mark.skipif(not PHILLY.exists(), reason="Philly trace not present")
def test_the_policy_object_decides_as_the_pure_function_round_after_round():
    # SingularityPolicy takes over last round's waiting jobs when their views come back
    # unchanged (speed); every round must still decide exactly as a fresh read would
    from backend.scheduler.singularity import PolicyConfig, SingularityPolicy, singularity_policy

    jobs = load_trace(PHILLY, seed=0, limit=400)
    config = PolicyConfig()
    runs = []
    for policy in (SingularityPolicy(config), lambda snap: singularity_policy(snap, config)):
        decided = []

        def record(snap, policy=policy, decided=decided):
            actions = policy(snap)
            decided.append((snap.now, actions))
            return actions

        record.min_move_interval_s = config.min_move_interval_s
        Simulator(jobs, 48, 8, 30.0, policy=record).run()
        runs.append(decided)
    assert len(runs[0]) > 1000 and runs[0] == runs[1]
    aged = [a for _, actions in runs[0] for a in actions if "aged past" in a.reason]
    assert aged  # the slice exercises aging, where a taken-over job changes tier
