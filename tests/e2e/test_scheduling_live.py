"""The Singularity policy live: premium work takes devices back, small jobs move to make room,
users in one tier share fairly. Every displaced job still produces exactly its own output."""
from __future__ import annotations

import time

from exactness import run_plain, source, stdout_lines, wait_for_lines
from singularity_sdk import Client, EventType, JobState, LocalCluster

STEADY = source("steady_rng.py")


def test_premium_job_preempts_basic_work_which_resumes_exactly(tmp_path):
    with LocalCluster(nodes=2, devices_per_node=1, home=tmp_path / "h", min_move_interval=2) as cluster, \
            cluster.client() as client:
        env = {"STEPS": "150"}  # ~7 s: the basic jobs still run when the premium one comes
        expected_lines, expected_result = run_plain(client, STEADY, env)
        basics = [client.submit(STEADY, sla="basic", name=f"basic-{i}", env=env) for i in range(2)]
        for job in basics:
            wait_for_lines(job, 5)
        t0 = time.time()
        premium = client.submit("print('premium work'); 'premium'", sla="premium", gpus=1, name="premium")
        assert premium.result(timeout=120) == "premium"
        started = next(e for e in premium.events(follow=False) if e.type == EventType.STARTED)
        assert started.time - t0 < 10, "the premium job started within seconds"
        victims = []
        for job in basics:
            assert job.wait(180) == JobState.SUCCEEDED
            assert stdout_lines(job) == expected_lines and job.result() == expected_result
            pre = [e for e in job.events(follow=False) if e.type == EventType.PREEMPTED]
            if pre:
                victims.append(job)
                assert "premium" in pre[0].data["reason"] and pre[0].data["by"] == "scheduler"
        assert len(victims) == 1  # one device was needed: one victim, not both


def test_fragmented_cluster_migrates_a_small_job_for_a_big_one(tmp_path):
    # A move must pay for itself: the policy weighs the movers' age (a proxy for how long they
    # will still hold the node) against the move's cost, here 0.5 s, so any job older than ~1 s
    # is worth moving for a waiting two-device job.
    with LocalCluster(nodes=2, devices_per_node=2, home=tmp_path / "h", min_move_interval=1,
                      move_cost=0.5) as cluster, cluster.client() as client:
        env = {"STEPS": "200"}
        expected_lines, expected_result = run_plain(client, STEADY, env)
        a, b, c = (client.submit(STEADY, name=n, env=env) for n in "abc")
        for job in (a, b, c):
            wait_for_lines(job, 2)
        nodes = {j.id: j.refresh().placement[0].node for j in (a, b, c)}
        # Free one device on the node holding two jobs: one device free on each node.
        crowded = max(set(nodes.values()), key=list(nodes.values()).count)
        victim = next(j for j in (a, b, c) if nodes[j.id] == crowded)
        victim.cancel()
        victim.wait(30)
        time.sleep(1.5)
        big = client.submit("'big'", gpus=2, name="big")
        assert big.result(timeout=120) == "big"
        assert len({p.node for p in big.placement}) == 1  # on one node, not spread
        for job in (a, b, c):
            if job is not victim:
                assert job.wait(180) == JobState.SUCCEEDED
                assert stdout_lines(job) == expected_lines and job.result() == expected_result
        # (checked once they are done: "migrated" is reported when the mover is back in place)
        moved = [j for j in (a, b, c) if j is not victim
                 and any(e.type == EventType.MIGRATED for e in j.events(follow=False))]
        assert len(moved) == 1


def test_two_users_in_one_tier_share_devices_fairly(tmp_path):
    code = "import time\ntime.sleep(1.0)\n'done'"
    with LocalCluster(nodes=2, devices_per_node=2, home=tmp_path / "h") as cluster, cluster.client() as alice:
        bob = Client(cluster.url, alice.create_user("bob"))
        alice_jobs = [alice.submit(code, name=f"alice-{i}") for i in range(8)]
        bob_jobs = [bob.submit(code, name=f"bob-{i}") for i in range(8)]
        for job in alice_jobs + bob_jobs:
            assert job.wait(180) == JobState.SUCCEEDED
        spans = []
        for owner, jobs in (("alice", alice_jobs), ("bob", bob_jobs)):
            for j in jobs:
                events = list(j.events(follow=False))
                begin = next(e.time for e in events if e.type == EventType.SCHEDULED)
                spans.append((begin, next(e.time for e in events if e.type == EventType.SUCCEEDED), owner))
        spans.sort()
        # FIFO would hold all four devices for alice until her eighth job started. Fair share
        # hands each freed device to the user holding fewer: once the first wave turns over,
        # both hold about half, while both still have work waiting.
        for begin, _end, _owner in spans[6:10]:
            held = {u: sum(1 for b, e, o in spans if o == u and b <= begin < e) for u in ("alice", "bob")}
            assert held["bob"] >= 1 and abs(held["alice"] - held["bob"]) <= 2, (held, spans)
        assert [o for _b, _e, o in spans[:8]].count("bob") >= 2
        bob.close()


def test_premium_job_shrinks_elastic_basic_work_which_grows_back_exactly(tmp_path):
    from exactness import rank_lines

    # long enough that the shrink, the premium job and the grow-back all fit inside it on a loaded machine
    ddp, env = source("ddp_train.py"), {"STEPS": "240", "STEP_SLEEP": "0.03"}
    with LocalCluster(nodes=1, devices_per_node=4, home=tmp_path / "h", min_move_interval=1,
                      move_cost=0.2) as cluster, cluster.client() as client:
        reference = client.submit(ddp, gpus=4, env=env, name="reference")
        assert reference.wait(180) == JobState.SUCCEEDED, reference.info.error
        basic = client.submit(ddp, gpus=4, env=env, sla="basic", name="elastic-basic")
        wait_for_lines(basic, 40)
        t0 = time.time()
        premium = client.submit("import time\ntime.sleep(2)\n'premium'", sla="premium", gpus=2, name="premium")
        assert premium.result(timeout=120) == "premium"
        started = next(e for e in premium.events(follow=False) if e.type == EventType.STARTED)
        assert basic.wait(240) == JobState.SUCCEEDED, basic.info.error
        ended = next(e for e in basic.events(follow=False) if e.type == EventType.SUCCEEDED)
        assert t0 < started.time < ended.time, "the premium job did not wait for the basic one"
        assert (rank_lines(basic), basic.result()) == (rank_lines(reference), reference.result())
        resized = [e.data for e in basic.events(follow=False) if e.type == EventType.RESIZED]
        assert [(d["from"], d["to"]) for d in resized] == [(4, 2), (2, 4)], resized  # shrunk, not preempted
        assert all(d["by"] == "scheduler" for d in resized)
        assert "premium" in resized[0]["reason"] and "idle" in resized[1]["reason"]
        assert not any(e.type == EventType.PREEMPTED for e in basic.events(follow=False))
