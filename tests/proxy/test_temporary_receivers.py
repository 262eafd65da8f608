"""``Trainer(cfg).fit()``: a method called on an object no name holds. A restore cannot evaluate
the receiver again (that would build a second trainer, printing and seeding again), so it takes
the receiver from the checkpointed frame of the method (its ``self``). Before, such a call was
no call site: no safe point inside the method was usable, and a stop waited for it to return."""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

TEMPORARY_TRAINER = """
import argparse
import torch

class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        print("built", cfg.seed)          # must not run again at a restore

    def fit(self):
        for epoch in range(self.cfg.epochs):
            for _ in range(3):
                loss = self.model(torch.randn(8, 3)).pow(2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            print(self.cfg.seed, epoch, round(loss.item(), 6))
        return round(loss.item(), 6)

class Sweep:
    def __init__(self, seeds):
        self.trainers = [Trainer(argparse.Namespace(seed=s, epochs=3)) for s in seeds]

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    final = Trainer(p.parse_args()).fit()
    print("final", final)
    sweep = Sweep([1, 2])
    results = [sweep.trainers[0].fit()]
    return Trainer(argparse.Namespace(seed=3, epochs=2)).fit(), results

if __name__ == "__main__":
    print(main())
"""


def test_a_method_called_on_a_temporary_object_has_safe_points_and_resumes_exactly(launcher, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TEMPORARY_TRAINER))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout.count("built") == 4, base.describe()
    inside = [t for t in trace if t["kind"] == "loop" and t.get("functions") == ["main", "fit"]]
    assert len(inside) >= 20, trace  # before: none (the stop waited until fit returned)
    stops = pick_stops(trace, 1, extra=4)
    out, _ = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout, f"stops {stops}"
