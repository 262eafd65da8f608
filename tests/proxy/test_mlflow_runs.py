"""MLflow's fluent API goes on logging to the same runs after a restore: one run, not a new one
per restore, with the uninterrupted run's parameters, tags, metrics (values and steps), nested
runs and statuses; a stop leaves the runs running and ends none of them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import EXIT_PREEMPTED, SCRIPTS, pick_stops, run_chain, trace_of

pytest.importorskip("mlflow", reason="the MLflow test needs the test extra (mlflow-skinny)")

#: mlflow 3 keeps its file store only on request: a job's folder is where these tests track
FILE_STORE = {"MLFLOW_ALLOW_FILE_STORE": "true"}
#: tags that differ between any two runs, or between `python train.py` and a run under the engine
_VOLATILE_TAGS = ("mlflow.source.name", "mlflow.parentRunId")


def tracked(out: Path) -> dict:
    """Every run under ``out`` by its name: status, parent's name, params, tags and metric histories."""
    from mlflow.tracking import MlflowClient

    os.environ.update(FILE_STORE)
    client = MlflowClient(tracking_uri=f"file:{out}")
    experiment = client.get_experiment_by_name("singularity-test")
    runs = client.search_runs([experiment.experiment_id])
    names = {r.info.run_id: r.info.run_name for r in runs}
    assert len(names) == len(set(names.values())), f"two runs with one name: {sorted(names.values())}"
    return {r.info.run_name: {
        "status": r.info.status,
        "parent": names.get(r.data.tags.get("mlflow.parentRunId")),
        "params": r.data.params,
        "tags": {k: v for k, v in r.data.tags.items() if k not in _VOLATILE_TAGS},
        "metrics": {key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
                    for key in r.data.metrics},
    } for r in runs}


@pytest.mark.parametrize("seed", [4])
def test_metrics_go_on_into_the_same_runs(launcher, tmp_path, seed):
    script = [str(SCRIPTS / "mlflow_train.py")]
    base, trace = trace_of(launcher, script, tmp_path, env=FILE_STORE, script_args=["--out", str(tmp_path / "base")])
    plain = tracked(tmp_path / "base")
    assert sorted(plain) == ["epoch-0", "epoch-1", "epoch-2", "fit"] and len(plain["fit"]["metrics"]["val_loss"]) == 3
    stops = pick_stops(trace, seed, extra=2)
    out, runs = run_chain(launcher, script, stops, tmp_path / "ck", env=FILE_STORE,
                          script_args=["--out", str(tmp_path / "chain")])
    assert out == base.stdout, runs[-1].describe()
    assert tracked(tmp_path / "chain") == plain


def test_a_stop_leaves_the_runs_running(launcher, tmp_path):
    script = [str(SCRIPTS / "mlflow_train.py")]
    _, trace = trace_of(launcher, script, tmp_path, env=FILE_STORE, script_args=["--out", str(tmp_path / "base")])
    inside = [t["step"] for t in trace if t["kind"] == "loop" and len(t["loops"]) == 2][4]  # in epoch 1's batches
    args = script + ["--checkpoint-dir", str(tmp_path / "ck"), "--", "--out", str(tmp_path / "chain")]
    stopped = launcher.run(args[:1] + ["--stop-at-step", str(inside)] + args[1:], FILE_STORE)
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    assert {name: run["status"] for name, run in tracked(tmp_path / "chain").items()} == \
        {"fit": "RUNNING", "epoch-0": "FINISHED", "epoch-1": "RUNNING"}
    restored = launcher.run(args[:1] + ["--restore"] + args[1:], FILE_STORE)
    assert restored.rc == 0, restored.describe()
    assert {name: run["status"] for name, run in tracked(tmp_path / "chain").items()} == \
        {"fit": "FINISHED", "epoch-0": "FINISHED", "epoch-1": "FINISHED", "epoch-2": "FINISHED"}
