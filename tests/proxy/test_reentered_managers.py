"""With statements a restore would enter again, where that differs from an uninterrupted run.
A context manager class of the job's own, and a ``@contextmanager`` of its own whose generator
can be saved, are held across the stop (held_managers.py): entered once, exited once. Where
that cannot be done a checkpoint inside them is refused, naming the statement and what to do,
and the job runs on. Each resumed silently wrong before: a class of
the job's own (its exit ran at the stop and its enter again at the restore: "enter"/"exit"
printed twice, a class counter drifting), a ``@contextmanager`` of the job's own,
``warnings.catch_warnings(record=True)`` (the warnings caught before the stop were
lost) and ``torch.autocast`` around the loop (its cache of low-precision weights started empty,
so the losses after the restore differed)."""
from __future__ import annotations

import textwrap

import pytest

from harness import pick_stops, run_chain, trace_of

OWN_GENERATOR = """
from contextlib import contextmanager

@contextmanager
def phase(name):
    print("begin", name)
    try:
        yield name.upper()
    finally:
        print("end", name)

with phase("train") as tag:
    for step in range(6):
        print(tag, step)
"""

OWN_CLASS = """
class Timer:
    depth = 0
    def __init__(self, name):
        self.name, self.n = name, 0
    def __enter__(self):
        Timer.depth += 1
        print("enter", self.name, Timer.depth)
        return self
    def __exit__(self, *exc):
        Timer.depth -= 1
        print("exit", self.name, self.n, Timer.depth)
        return False

def main():
    with Timer("fit") as t, open(__file__ + ".log", "w") as log:
        for step in range(6):
            t.n += 1
            log.write(f"{step}\\n")
            print(step, t.n, Timer.depth)
    print("final", Timer.depth, open(__file__ + ".log").read().split())

main()
"""

RECORDED_WARNINGS = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(6):
        warnings.warn(f"step {step}")
        print(step, len(caught))
"""

AUTOCAST = """
import torch
torch.manual_seed(1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.autocast("cpu", dtype=torch.bfloat16):
    for step in range(6):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, loss.item().hex())
"""


OWN_GENERATOR_SENDING = """
from contextlib import contextmanager

@contextmanager
def phase(name):
    print("begin", name)
    got = yield name.upper()  # the value of a yield: not a shape a checkpoint can save
    print("end", name, got)

with phase("train") as tag:
    for step in range(6):
        print(tag, step)
"""


def test_a_contextmanager_of_the_job_is_held_entered_and_exited_once(launcher, tmp_path):
    """``@contextmanager`` around the loop, with ``try``/``finally`` around its yield: its
    generator is saved where it waits, the stop does not run the finally block and the restore
    does not run the code before the yield again; "begin" and "end" print once, as without stops."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(OWN_GENERATOR))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.stdout.count("begin train") == 1 and base.stdout.count("end train") == 1
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, _ = run_chain(launcher, [str(script)], [loops[1], loops[3], loops[4]], tmp_path / "ck")
    assert out == base.stdout


@pytest.mark.parametrize("source, named", [
    (OWN_GENERATOR_SENDING, "phase(), a @contextmanager, a context manager of the job's own"),
    (RECORDED_WARNINGS, "warnings.catch_warnings(record=True)"),
    (AUTOCAST, "torch.autocast around the loop"),
], ids=["contextmanager", "catch_warnings", "autocast"])
def test_a_checkpoint_inside_a_manager_a_restore_would_enter_again_is_refused(launcher, tmp_path, source, named):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    step = [t["step"] for t in trace if t["kind"] == "loop"][2]
    run = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert run.rc == 0 and run.stdout == base.stdout, run.describe()
    failed = [d["error"] for _, d in run.events("checkpoint_failed")]
    assert len(failed) == 1 and "the with statement at line" in failed[0] and named in failed[0], failed


def test_a_library_manager_that_only_switches_a_mode_still_resumes(launcher, tmp_path):
    """``torch.no_grad()`` and a ``catch_warnings()`` that records nothing are entered again, exactly."""
    script = tmp_path / "eval.py"
    script.write_text(textwrap.dedent("""
        import warnings, torch
        torch.manual_seed(0)
        w = torch.randn(3)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(6):
                w = w * 0.5 + torch.randn(3)
                print(step, w.sum().item().hex(), torch.is_grad_enabled())
    """))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    step = [t["step"] for t in trace if t["kind"] == "loop"][2]
    first = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert first.events("stopped"), first.describe()
    rest = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--restore"])
    assert first.stdout + rest.stdout == base.stdout, rest.describe()


def test_a_context_manager_class_of_the_job_is_entered_and_exited_once(launcher, tmp_path):
    script = tmp_path / "timer.py"
    script.write_text(textwrap.dedent(OWN_CLASS))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.stdout.count("enter fit") == 1 and "final 0 ['0', '1', '2', '3', '4', '5']" in base.stdout
    for seed in (1, 2):
        out, _ = run_chain(launcher, [str(script)], pick_stops(trace, seed, extra=2), tmp_path / f"ck{seed}")
        assert out == base.stdout, seed


FORKED_GENERATORS = """
import random
import numpy as np
import torch

def validate(model):
    # random crops in evaluation must not move the training's generators
    with torch.random.fork_rng(), torch.no_grad():
        total = 0.0
        for batch in range(3):
            total += model(torch.randn(2, 4) * torch.rand(1)).sum().item()
            print("  val", batch, total.hex())
    return total

def main():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        for step in range(3):
            loss = model(torch.randn(5, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        val = validate(model)
        print(epoch, loss.item().hex(), val.hex(), random.random(), np.random.rand())

main()
"""


def test_a_manager_that_puts_the_generators_back_finds_what_it_found_first(launcher, tmp_path):
    """``with torch.random.fork_rng():`` (and Lightning's ``isolate_rng`` around its sanity check)
    puts back at its end the generators it found when entered. A restore enters it again before
    the checkpoint's generators are set, so it put back a fresh process's: every draw after the
    block differed. The checkpoint records what it found (runtime.py's `with_ctx`)."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent(FORKED_GENERATORS))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    inside = [t["step"] for t in trace if t["kind"] == "loop" and "validate" in t.get("functions", [])]
    assert len(inside) >= 9, trace
    out, runs = run_chain(launcher, [str(script)], [inside[1], inside[5], inside[-2]], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()
