"""A Weights & Biases run is continued on restore: same id, the steps and values of the
uninterrupted run, its config and summary; what was logged before a stop is written, not lost.

Runs offline (no server): wandb writes each process's records to a file of its own, which
``wandb sync`` uploads into one run. The test compares what a plain run logged with what a chain
of stops and restores logged, row by row (`wandb_records.logged`)."""
from __future__ import annotations

import pytest

from backend.proxy.engine import wandb_runs
from harness import EXIT_PREEMPTED, SCRIPTS, pick_stops, run_chain, trace_of

pytest.importorskip("wandb", reason="the W&B test needs the test extra (wandb)")

from wandb_records import logged  # noqa: E402

@pytest.mark.parametrize("seed, steps", [(3, "implicit"), (11, "explicit")])
def test_run_goes_on_with_the_same_id_steps_and_values(launcher, tmp_path, seed, steps):
    script = [str(SCRIPTS / "wandb_train.py")]
    flags = ["--explicit-steps"] if steps == "explicit" else []
    base, trace = trace_of(launcher, script, tmp_path, script_args=["--out", str(tmp_path / "base"), *flags])
    plain = logged(tmp_path / "base")
    assert len(plain["rows"]) == (12 if flags else 4) and plain["exits"] == [0]
    assert plain["summary"]["best_val"] > 0 and any("gradients/weight/bins" in r for r in plain["rows"])  # wandb.watch
    # an open row (commit=False before the batches, or step= given) is held across the stops inside them
    stops = pick_stops(trace, seed, extra=2)
    # the same program logging elsewhere: its safe points are the base run's (--out is not in a loop)
    out, runs = run_chain(launcher, script, stops, tmp_path / "ck",
                          script_args=["--out", str(tmp_path / "chain"), *flags])
    assert out == base.stdout, runs[-1].describe()
    chain = logged(tmp_path / "chain")
    assert chain["rows"] == plain["rows"]
    assert chain["summary"] == plain["summary"]
    assert {k: v for k, v in chain["config"].items() if k != "out"} == \
        {k: v for k, v in plain["config"].items() if k != "out"}
    assert len(chain["ids"]) == len(stops) + 1 and len(set(chain["ids"])) == 1  # one run, a record per process
    assert chain["exits"] == [EXIT_PREEMPTED] * len(stops) + [0]  # each stop ended its record as preempted


FINISHED_AND_DISABLED = """
import sys
import wandb

first = wandb.init(project="p", dir=OUT, mode="offline", config={"a": 1})
first.log({"x": 1})
first.finish()
off = wandb.init(mode="disabled")
total = 0
for i in range(6):
    total += i
    wandb.log({"total": total})
    print(i, total)
print("names", bool(first.id), first.config["a"])
try:
    first.log({"x": 2})
except wandb.errors.UsageError as e:
    print("finished run refuses:", type(e).__name__)
"""


def test_finished_and_disabled_runs_are_saved(launcher, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FINISHED_AND_DISABLED.replace("OUT", repr(str(tmp_path / "w"))))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert "finished run refuses: UsageError" in base.stdout
    loop = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(script)], [loop[2]], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()


def test_reduce_leaves_other_objects_alone():
    assert wandb_runs.reduce(object()) is NotImplemented
    assert wandb_runs.reduce({"a": 1}) is NotImplemented
