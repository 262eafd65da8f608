"""How long a periodic checkpoint of a tiny model holds the training loop: the safe point's fixed cost.

    python bench/snapshot_fixed_cost.py [--steps 1500] [--every 0.05] [--runs 2]

A small MLP with Adam (3 ms steps) runs under the engine with ``--checkpoint-every``; each
checkpoint is taken behind the loop, so what it holds the loop for (``checkpointed``'s
``snapshot_s``) is the work that does not depend on the state's size: building and pickling the
graph, the events, starting the writer. Prints the median, quartile and minimum per run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.rand(32, 64)
for step in range({steps}):
    t = time.perf_counter()
    loss = model(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    while time.perf_counter() < t + 0.003:
        pass
'''


def run(steps: int, every: float, folder: Path) -> list[float]:
    script = folder / "tiny.py"
    script.write_text(SCRIPT.format(steps=steps))
    out = subprocess.run([sys.executable, "-m", "backend.proxy", str(script), "--checkpoint-dir", str(folder / "ck"),
                          "--checkpoint-every", str(every)], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return [json.loads(line.split(" ", 2)[2])["snapshot_s"] * 1e3 for line in out.stderr.splitlines()
            if line.startswith("[proxy] checkpointed ")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=float, default=0.05)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    print(f"{'run':>4} {'ckpts':>6} {'median':>9} {'p25':>9} {'min':>9}")
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            held = run(args.steps, args.every, Path(tmp))
        print(f"{i + 1:>4} {len(held):>6} {statistics.median(held):>6.2f} ms "
              f"{statistics.quantiles(held, n=4)[0]:>6.2f} ms {min(held):>6.2f} ms")


if __name__ == "__main__":
    main()
