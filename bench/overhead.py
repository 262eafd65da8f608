"""Steady-state overhead of the device proxy: one training script, three ways, interleaved.

    python bench/overhead.py [--rounds 9] [--steps 500] [--quick] [--in-function]

The same script (an MLP + Adam on synthetic data, one thread, a few ms per step) runs

  (a) as plain ``python script.py``,
  (b) as a job on a 1-node LocalCluster (worker, AST-rewritten loops, control pipe, log pump),
  (c) as ``python -m backend.proxy script.py`` locally (the rewrite engine alone),

in rounds a, b, c (the order rotates each round, so no mode always follows another). The script
times each iteration itself with ``time.perf_counter`` and prints, at the end, the median, the
10th percentile and the mean iteration time over the steady-state iterations (after ``--warmup``
warm-up steps); start-up is therefore not part of the figure. The table gives, per mode, the
median over rounds of each run's median iteration and of its 10th-percentile iteration (the
least disturbed iterations: this machine is shared and noisy), the ratios b/a and c/a (target:
<= 1.01), and the spread of the per-round ratios.

``--in-function`` moves everything after the imports into ``def main():``, called under
``if __name__ == "__main__":`` (the usual script shape): the training loop then runs inside a
function, whose loops the engine makes safe points too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from singularity_sdk import JobState, LocalCluster  # noqa: E402

MARK = "BENCH_OVERHEAD "

SCRIPT = '''\
import json
import time

import torch

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(4096, 256)
y = torch.randn(4096, 1)
STEPS = {steps}
WARMUP = {warmup}
times = []
last = time.perf_counter()
for step in range(STEPS):
    i = (step * 128) % 4096
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[i:i + 128]), y[i:i + 128])
    loss.backward()
    opt.step()
    now = time.perf_counter()
    times.append(now - last)
    last = now
steady = sorted(times[WARMUP:])
print("{mark}" + json.dumps({{"median_s": steady[len(steady) // 2], "p10_s": steady[len(steady) // 10],
                              "mean_s": sum(steady) / len(steady),
                              "n": len(steady), "loss": loss.item()}}), flush=True)
'''

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def in_function(source: str) -> str:
    """The same script with its body (after ``torch.set_num_threads``) inside ``main()``."""
    head, marker, body = source.partition("torch.set_num_threads(1)\n")
    indented = "".join(f"    {line}" if line.strip() else line for line in body.splitlines(keepends=True))
    return f"{head}{marker}\n\ndef main():\n{indented}\n\nif __name__ == \"__main__\":\n    main()\n"


def parse(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"no {MARK.strip()} line in the output:\n{text[-2000:]}")


def run_plain(script: Path) -> dict:
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                         env={**os.environ, **THREAD_ENV}, timeout=300)
    return parse(out.stdout)


def run_proxy(script: Path, ckpt: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "backend.proxy", str(script), "--checkpoint-dir", str(ckpt)],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, **THREAD_ENV}, timeout=300)
    return parse(out.stdout)


def run_job(client, source: str, n: int) -> dict:
    job = client.submit(source, name=f"overhead-{n}", env=THREAD_ENV, filename="train.py")
    state = job.wait(300)
    if state != JobState.SUCCEEDED:
        raise RuntimeError(f"job {job.id} ended {state.value}:\n{job.logs()[-2000:]}")
    return parse(job.logs())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="3 rounds of 150 steps (a smoke run)")
    p.add_argument("--in-function", action="store_true", help="the training loop inside main()")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 150
    source = SCRIPT.format(steps=args.steps, warmup=args.warmup, mark=MARK)
    if args.in_function:
        source = in_function(source)
    modes = ["a", "b", "c"]
    labels = {"a": "(a) plain python script.py", "b": "(b) job on LocalCluster",
              "c": "(c) python -m backend.proxy"}
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    p10: dict[str, list[float]] = {m: [] for m in modes}
    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp, \
            LocalCluster(nodes=1, devices_per_node=1) as cluster, cluster.client() as client:
        script = Path(tmp) / "train.py"
        script.write_text(source)
        runners = {"a": lambda: run_plain(script),
                   "b": lambda: run_job(client, source, len(per_round["b"])),
                   "c": lambda: run_proxy(script, Path(tmp) / "ckpt")}
        for m in modes:  # warm-up round (page cache, torch's first import), not counted
            runners[m]()
        for r in range(args.rounds):
            order = modes[r % 3:] + modes[:r % 3]
            for m in order:
                res = runners[m]()
                per_round[m].append(res["median_s"])
                p10[m].append(res["p10_s"])
            print(f"round {r + 1}/{args.rounds} ({''.join(order)}): " +
                  "  ".join(f"{m} {per_round[m][-1] * 1e3:.3f} ms" for m in modes), flush=True)
    took = time.monotonic() - t_start
    med = {m: statistics.median(per_round[m]) for m in modes}
    fast = {m: statistics.median(p10[m]) for m in modes}
    steady = args.steps - args.warmup
    print(f"\n{args.rounds} interleaved rounds, {steady} steady-state iterations each "
          f"(first {args.warmup} excluded), 1 thread; {took:.0f} s in all; "
          f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end\n")
    print("median: each run's median iteration, median over the rounds; fast 10%: each run's 10th-percentile\n"
          "iteration (the least disturbed), median over the rounds; ratios are to (a)\n")
    print(f"{'mode':<30} {'median ms':>10} {'ratio':>7} {'fast 10% ms':>12} {'ratio':>7} "
          f"{'per-round median ratios':>24}")
    for m in modes:
        if m == "a":
            ratio, fratio, spread = "1.000", "1.000", "-"
        else:
            rr = [x / y for x, y in zip(per_round[m], per_round["a"])]
            ratio, fratio = f"{med[m] / med['a']:.3f}", f"{fast[m] / fast['a']:.3f}"
            spread = f"{min(rr):.3f}..{max(rr):.3f}"
        print(f"{labels[m]:<30} {med[m] * 1e3:10.3f} {ratio:>7} {fast[m] * 1e3:12.3f} {fratio:>7} {spread:>24}")
    print()
    for m in ("b", "c"):
        ratio = med[m] / med["a"]
        print(f"{labels[m]} vs plain, target <= 1.01: {'met' if ratio <= 1.01 else 'NOT met'} "
              f"(median ratio {ratio:.3f}, fast-10% ratio {fast[m] / fast['a']:.3f})")

if __name__ == "__main__":
    main()
