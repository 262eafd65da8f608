"""What the sandbox costs a job's start and its restore, side by side in one run.

    python bench/sandbox_start.py [--jobs 10]

Three nodes set-ups, each a LocalCluster of one node, measured after its warm spawner is ready:
no sandbox (a fork of the warm spawner), a fork that makes its own sandbox
(backend/namespaces.py), and a fresh interpreter under bwrap (SINGULARITY_WARM_WORKERS=0).
"submit -> first line": from the SDK's submit to the job's first printed line reaching the SDK.
"resume -> next line": a small torch job is preempted (checkpoint written), then resumed; from
the resume call to its next printed line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from processes import until_workers_fork  # noqa: E402

from singularity_sdk import EventType, JobState, LocalCluster  # noqa: E402

TRAIN = """\
import time, torch
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(400):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print("step", step, flush=True)
    time.sleep(0.05)
"""

MODES = {
    "no sandbox, fork": dict(sandbox="off", env={}),
    "sandbox, fork": dict(sandbox="bwrap", env={}),
    "sandbox, fresh (bwrap)": dict(sandbox="bwrap", env={"SINGULARITY_WARM_WORKERS": "0"}),
}


def first_line(client) -> float:
    t0 = time.time()
    job = client.submit("print('up')")
    for ev in job.events():
        if ev.type == EventType.LOG:
            return time.time() - t0
    raise RuntimeError(f"{job.id} printed nothing")


def resume_to_next_line(client) -> float:
    job = client.submit(TRAIN, name="restore")
    while "step 5" not in job.logs():
        time.sleep(0.05)
    job.preempt(timeout=120)
    seen = len([e for e in job.events(follow=False)])
    t0 = time.time()
    job.resume()
    for ev in job.events(since=seen):
        if any(line.startswith("step") for line in ev.lines):
            took = time.time() - t0
            break
    job.cancel()
    assert job.wait(60) in (JobState.CANCELLED, JobState.SUCCEEDED)
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10)
    args = ap.parse_args()
    rows = {}
    for mode, opts in MODES.items():
        with LocalCluster(nodes=1, devices_per_node=1, sandbox=opts["sandbox"], env=opts["env"]) as cluster, \
                cluster.client() as client:
            if not opts["env"]:
                until_workers_fork(client)
            starts = [first_line(client) for _ in range(args.jobs)]
            restores = [resume_to_next_line(client) for _ in range(max(3, args.jobs // 3))]
        rows[mode] = (statistics.median(starts), max(starts), statistics.median(restores), max(restores))
    base = rows["no sandbox, fork"]
    print(f"{args.jobs} starts and {max(3, args.jobs // 3)} restores per set-up; seconds")
    print(f"{'set-up':<24}{'start p50':>10}{'max':>8}{'ratio':>7}{'restore p50':>13}{'max':>8}{'ratio':>7}")
    for mode, (s50, smax, r50, rmax) in rows.items():
        print(f"{mode:<24}{s50:>10.3f}{smax:>8.3f}{s50 / base[0]:>7.2f}{r50:>13.3f}{rmax:>8.3f}{r50 / base[2]:>7.2f}")


if __name__ == "__main__":
    main()
