"""Lightning's ``Trainer.fit`` is stopped inside its epoch loop, its validation loop and its
sanity check and resumed exactly: the modules from ``trainer.fit(...)`` down to the epoch and
validation loops are rewritten by default (libraries.py), and the
objects Lightning pickles without what a spawned process could not take (the model's trainer,
the DataLoader iterators of its combined loader) are saved whole."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness import PYTHON, SCRIPTS, pick_stops, run_chain, trace_of

pytest.importorskip("lightning", reason="the Lightning test needs the trainers extra (lightning)")

import torch  # noqa: E402

SCRIPT = SCRIPTS / "lightning_train.py"


def outputs(out: Path) -> dict:
    """What the run saved under ``out``: the CSV log and hyperparameters as bytes, and the best
    model's checkpoint by value (it records absolute paths, here each run's own ``out``)."""
    saved = {p.relative_to(out).as_posix(): p.read_bytes()
             for p in sorted(out.rglob("*")) if p.suffix in (".csv", ".yaml")}
    for ckpt in sorted(out.rglob("*.ckpt")):
        content = torch.load(ckpt, weights_only=False)
        saved[ckpt.relative_to(out).as_posix()] = _flat(content, str(out))
    return saved


def _flat(value, out: str, path: str = "") -> dict:
    """``value`` as {path: leaf}, tensors by dtype, shape and values, ``out`` in strings and keys as <out>."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in _flat(item, out, f"{path}/{str(key).replace(out, '<out>')}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, out, f"{path}[{i}]").items()}
    if isinstance(value, torch.Tensor):
        return {path: (value.dtype, tuple(value.shape), value.flatten().tolist())}
    return {path: value.replace(out, "<out>") if isinstance(value, str) else value}


@pytest.mark.parametrize("seed", [2])
def test_fit_resumes_exactly_inside_its_epoch_loop(launcher, tmp_path, seed):
    plain = subprocess.run([PYTHON, str(SCRIPT), "--out", str(tmp_path / "plain")], capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    base, trace = trace_of(launcher, [str(SCRIPT)], tmp_path, script_args=["--out", str(tmp_path / "base")])
    assert base.stdout == plain.stdout
    assert outputs(tmp_path / "base") == outputs(tmp_path / "plain")
    inside = [t for t in trace if t["kind"] == "loop" and "run" in t.get("functions", [])]
    assert inside, "no safe point inside Trainer.fit's loops"
    # the sanity check runs inside `with isolate_rng():`, which puts back the generators it found
    sanity = [t["step"] for t in trace if "_run_sanity_check" in t.get("functions", [])]
    validating = [t["step"] for t in trace if t["kind"] == "loop"
                  and t.get("functions", [])[-2:] == ["_decorator", "run"] and t["step"] > sanity[-1]]
    assert sanity and validating, "no safe point inside the sanity check or the validation loop"
    stops = sorted({*pick_stops(inside, seed, extra=1), sanity[len(sanity) // 2], validating[len(validating) // 2]})
    out, runs = run_chain(launcher, [str(SCRIPT)], stops, tmp_path / "ck",
                          script_args=["--out", str(tmp_path / "chain")])
    assert out == plain.stdout, runs[-1].describe()
    assert outputs(tmp_path / "chain") == outputs(tmp_path / "plain")
