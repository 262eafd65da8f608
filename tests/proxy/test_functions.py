"""Safe points inside functions and methods: programs in the shapes people write (the loop in
``main()``, a ``Trainer`` class, closures, ``train(next(it))``) run under the engine exactly as
plain Python does, and stopping them at seeded random safe points, each restore in a new
process, prints bitwise the same as the uninterrupted run."""
from __future__ import annotations

import ast
import contextlib
import io
import os
import subprocess
import threading

import pytest

from backend.proxy import CheckpointStore, Controller, Preempted, ResumableProgram
from backend.proxy.engine.analysis import not_rewritable
from harness import PYTHON, ROOT, SCRIPTS, pick_stops, run_chain, trace_of, uninterrupted

FUNCTIONS = SCRIPTS / "functions"


def _plain(script: str, script_args: tuple[str, ...] = ()) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([PYTHON, script, *script_args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _check(launcher, name: str, tmp_path, seed: int, extra: int = 3,
           script_args: tuple[str, ...] = ()) -> tuple[list[dict], list[int]]:
    """Plain python == uninterrupted engine run == the run stopped and restored at seeded stops."""
    script = str(FUNCTIONS / name)

    def like_plain_python(stdout: str) -> None:
        assert stdout == _plain(script, script_args)

    expected, trace = uninterrupted(launcher, " ".join((name, *script_args)), [script], tmp_path, like_plain_python,
                                    script_args=script_args)
    stops = pick_stops(trace, seed, extra)
    by_step = {t["step"]: t for t in trace}
    inside = [s for s in stops if by_step[s].get("functions")]
    assert len(inside) >= 3, f"want stops inside functions, got {stops}"
    out, _ = run_chain(launcher, [script], stops, tmp_path / "ck", script_args=script_args)
    assert out == expected, f"stops {stops}"
    return trace, stops


def _functions(trace: list[dict]) -> set[tuple[str, ...]]:
    return {tuple(t.get("functions", ())) for t in trace}


@pytest.mark.parametrize("seed", [1, 2])
def test_loop_in_main_under_the_main_guard(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "main_loop.py", tmp_path, seed)
    assert ("main",) in _functions(trace)
    assert all(t.get("functions") == ["main"] for t in trace if t["kind"] == "loop")


@pytest.mark.parametrize("seed", [3, 4])
def test_trainer_class_with_fit_train_epoch_and_evaluate(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "trainer.py", tmp_path, seed, extra=4)
    assert {("main", "fit"), ("main", "fit", "train_epoch"), ("main", "fit", "evaluate")} <= _functions(trace)


@pytest.mark.parametrize("seed", [5, 6])
def test_closure_decorator_and_side_effecting_arguments(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "closures.py", tmp_path, seed, extra=4)
    assert {("main", "wrapper", "train"), ("main", "accumulate"), ("main", "evaluate")} <= _functions(trace)


@pytest.mark.parametrize("seed", [7, 8])
def test_mlp_adam_training_in_main_with_argparse(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "mlp_adam.py", tmp_path, seed)
    assert ("main",) in _functions(trace)


@pytest.mark.parametrize("seed", [11, 12])
def test_closures_over_rebound_variables_keep_their_functions_safe_points(launcher, tmp_path, seed):
    """LBFGS's ``def closure()`` in the loop, late-binding hooks, a nonlocal counter: such a
    function ran unchanged before (its loops could not be checkpointed); its shared variables now
    live in one object that the frame and its closures share after a restore too."""
    trace, _ = _check(launcher, "shared_cells.py", tmp_path, seed, extra=4)
    assert {("main",), ("main", "fit"), ("main", "run")} <= _functions(trace)


@pytest.mark.parametrize("seed", [13, 14])
def test_a_main_under_torchruns_record_decorator_has_usable_safe_points(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "record_main.py", tmp_path, seed, extra=4)
    assert {("main",), ("main", "fit")} <= _functions(trace)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_loops_under_grad_mode_decorators_resume_with_the_callers_mode_put_back(launcher, tmp_path, seed):
    """``@torch.no_grad()`` on ``evaluate``, ``@torch.inference_mode()``, ``@torch.enable_grad()``
    after a plain ``set_grad_enabled(False)``: their loops are safe points (they were not), and
    after a restore inside one, the decorator puts back on return the mode its caller had."""
    trace, _ = _check(launcher, "grad_decorators.py", tmp_path, seed, extra=6)
    assert {("main", "evaluate"), ("main", "predict"), ("main", "finetune")} <= _functions(trace)


@pytest.mark.parametrize("seed", [15, 16])
def test_a_click_command_as_main_has_usable_safe_points(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "click_main.py", tmp_path, seed, extra=4)
    assert ("main",) in _functions(trace)


@pytest.mark.parametrize("script,args", [
    ("fire_main.py", ("--steps", "7", "--name", "fired")),
    ("typer_run.py", ("--steps", "7", "--lr", "0.04", "--hidden", "6,5")),
    ("typer_app.py", ("train", "--steps", "7")),
])
def test_command_line_libraries_as_the_entry_point_have_usable_safe_points(launcher, tmp_path, script, args):
    """``fire.Fire(main)``, ``typer.run(main)``, a typer app with two commands: the library's frames
    stand between the top level and ``main``; a restore calls the entry point again as the call
    site did, and the library parses the carried ``sys.argv`` into the same call."""
    trace, _ = _check(launcher, script, tmp_path, seed=17, extra=4, script_args=args)
    assert {("main",), ("main", "fit")} <= _functions(trace), _functions(trace)


@pytest.mark.parametrize("seed", [19, 20])
def test_a_hydra_main_resumes_in_its_one_output_folder_with_hydras_state(launcher, tmp_path, seed):
    """``@hydra.main``: stopped and restored at random stops, the job prints what ``python
    hydra_main.py`` prints, and its output folder holds the same model, weights, hydra config and
    log file as the plain run's: one folder (a restore does not run hydra's setup again, which
    would make another), ``HydraConfig.get()`` and ``${hydra:...}`` answer after a restore, the
    job goes on in the folder hydra changed to, and the log handlers keep writing to its file."""
    script = str(FUNCTIONS / "hydra_main.py")
    args = ("epochs=6", "lr=0.04")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_OUT": str(tmp_path / "plain")}
    plain = subprocess.run([PYTHON, script, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert plain.returncode == 0, plain.stderr
    run, trace = trace_of(launcher, [script], tmp_path, env={"HYDRA_OUT": str(tmp_path / "base")}, script_args=args)
    assert run.stdout == plain.stdout
    stops = pick_stops(trace, seed, extra=4)
    assert sum(1 for s in stops if "main" in next(t for t in trace if t["step"] == s).get("functions", ())) >= 3
    out, _ = run_chain(launcher, [script], stops, tmp_path / "ck", env={"HYDRA_OUT": str(tmp_path / "chain")},
                       script_args=args)
    assert out == plain.stdout, f"stops {stops}"

    def folder(name: str) -> dict[str, bytes]:
        root = tmp_path / name
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return {k: v.replace(str(root).encode(), b"OUT") for k, v in files.items()}

    assert folder("chain") == folder("plain"), f"stops {stops}"
    assert {p.name for p in tmp_path.iterdir()} >= {"plain", "chain"}


def test_a_click_command_called_with_arguments_keeps_its_loops_unusable(tmp_path):
    """Called again, a command would get no arguments: ``main([], standalone_mode=False)`` would then
    exit where the program goes on. Its safe points stay unusable (the request waits)."""
    src = ("import click\n@click.command()\ndef main():\n    for i in range(3):\n        pass\n"
           "main([], standalone_mode=False)\nfor j in range(2):\n    pass\n")
    seen: list = []
    ctl = Controller(CheckpointStore(tmp_path / "ck"))
    ctl.trace_safe_points(lambda step, where: seen.append(where.get("functions", [])))
    ResumableProgram.from_source(src, "<click>").run({"__name__": "__main__"}, ctl)
    assert seen and ["main"] not in seen


def test_a_request_that_meets_only_a_decorators_safe_points_says_why_when_it_gives_up(tmp_path):
    """``@torch.autocast("cpu")`` on the function with the loop: a restore could not call the
    wrapper again (it would put back the autocast state it found), so the request waits, and its
    timeout answer says which wrapper and what to write instead, not only where the job was."""
    import torch  # noqa: F401  (imported before the program runs: the request must find it in its loop)

    src = ("import time, torch\n@torch.autocast('cpu')\ndef main():\n    for step in range(60):\n"
           "        time.sleep(0.05)\nmain()\n")
    events: list = []
    ctl = Controller(CheckpointStore(tmp_path / "ck"), on_event=lambda kind, data: events.append((kind, data)))
    threading.Timer(1.0, lambda: ctl.request_checkpoint("stop", "test", timeout_s=0.5)).start()
    out, preempted = _run(src, ctl)
    assert preempted is None
    errors = [data["error"] for kind, data in events if kind == "checkpoint_failed"]
    assert len(errors) == 1 and "a decorator's wrapper of main()" in errors[0], errors
    assert "a `with` block of that context manager instead" in errors[0] and "in main" in errors[0], errors


@pytest.mark.parametrize("src,usable", [
    ("import threading\ndef train(n):\n    for i in range(n):\n        pass\n"
     "threading.Thread(target=train, args=(3,)).start()\n", False),  # a library calls it: told at start
    ("import torch.multiprocessing as mp\ndef work(rank):\n    for i in range(3):\n        pass\n"
     "mp.spawn(work, nprocs=1)\n", True),  # rewritten into a call of work (spawned.py)
    ("def run(fn):\n    return fn()\ndef train():\n    for i in range(3):\n        pass\nrun(train)\n", True),
    ("import fire\ndef train():\n    for i in range(3):\n        pass\nfire.Fire(train)\n", True),  # called again
    ("import fire\ndef train():\n    for i in range(3):\n        pass\nfire.Fire({'t': train})\n", False),
])
def test_loops_of_a_function_only_a_library_calls_are_reported_as_not_usable(src, usable):
    from backend.proxy.engine import interruptible

    report = interruptible.report(ResumableProgram.from_source(src, "<f>"))
    assert report["interruptible"] is usable, report
    if not usable:
        assert "train() is called by" in report["not_safe_points"][0]["why"]


@pytest.mark.parametrize("seed", [9, 10])
def test_unsupported_shapes_run_unchanged_and_resume_around_them(launcher, tmp_path, seed):
    trace, _ = _check(launcher, "fallbacks.py", tmp_path, seed)
    chains = _functions(trace)
    for chain in chains:
        assert len(set(chain)) == len(chain), f"a safe point inside recursion: {chain}"
        assert not {"numbers", "rebinding", "worker"} & set(chain), chain
    assert ("main", "walk") in chains and ("main", "fib") in chains


def _run(src: str, ctl: Controller, restore=None) -> tuple[str, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            ResumableProgram.from_source(src).run({}, ctl, restore=restore)
        except Preempted as p:
            return out.getvalue(), p
    return out.getvalue(), None


def test_a_request_inside_recursion_waits_for_the_first_usable_safe_point(tmp_path):
    src = """
def down(n):
    for i in range(2):
        if n:
            down(n - 1)
        print("at", n, i)
def main():
    for k in range(2):
        down(2)
main()
"""
    steps: list[tuple[int, dict]] = []
    tracer = Controller(CheckpointStore(tmp_path / "t"))
    tracer.trace_safe_points(lambda step, pos: steps.append((step, pos)))
    plain, _ = _run(src, tracer)
    usable = [s for s, _ in steps]
    hidden = next(s for s in range(1, usable[-1]) if s not in usable)  # a loop step inside down(1)
    ctl = Controller(CheckpointStore(tmp_path / "ck"))
    ctl.checkpoint_at_step(hidden, "stop")
    first, stopped = _run(src, ctl)
    assert stopped is not None
    assert stopped.checkpoint.step == min(s for s in usable if s > hidden)
    rest, again = _run(src, Controller(CheckpointStore(tmp_path / "ck")), restore=stopped.checkpoint)
    assert again is None and first + rest == plain


def test_locals_shared_between_frames_stay_shared(tmp_path):
    src = """
class Box:
    pass
def inner(a, box):
    for i in range(3):
        a.append(i)
        print(i, a is box.items, len(box.items))
def outer():
    box = Box()
    box.items = []
    items = box.items
    inner(items, box)
    print("outer", items is box.items, items)
outer()
"""
    plain, _ = _run(src, Controller(CheckpointStore(tmp_path / "t")))
    for step in (2, 3, 4):
        ctl = Controller(CheckpointStore(tmp_path / f"ck{step}"))
        ctl.checkpoint_at_step(step, "stop")
        first, stopped = _run(src, ctl)
        assert stopped is not None and stopped.checkpoint.step == step
        rest, _ = _run(src, Controller(CheckpointStore(tmp_path / f"ck{step}")), restore=stopped.checkpoint)
        assert first + rest == plain
        assert "True" in rest and "False" not in rest


def test_functions_of_a_finished_run_keep_working(tmp_path):
    src = "def total(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s\n"
    ns: dict = {}
    ResumableProgram.from_source(src).run(ns, Controller(CheckpointStore(tmp_path / "ck")))
    assert not [k for k in ns if k.startswith("__sg_")]
    assert ns["total"](5) == 10


@pytest.mark.parametrize("code,reason", [
    # an LBFGS closure's own `loss` is not the `loss` of the loop that calls it
    ("def main():\n    x = 2\n    for i in range(3):\n        def closure():\n            loss = x * 2\n"
     "            return loss\n        loss = closure()\n", ""),
    ("def main():\n    x = 1\n    x = 2\n    total = [x for _ in range(2)]\n", ""),  # a comprehension runs at once
    ("def main():\n    lr = 1.0\n    decay = lambda: lr * 0.5\n    for i in range(3):\n        lr = decay()\n",
     "a closure shares lr, which the function rebinds"),
    ("def main():\n    x = 1\n    def f():\n        def g():\n            return x\n        return g\n    x = 2\n",
     "a closure shares x, which the function rebinds"),
    ("def main():\n    x = 1\n    class A:\n        def m(self):\n            return x\n    x = 2\n",
     "a closure shares x, which the function rebinds"),
    # a counter factory inside main: `nonlocal n` rebinds make_counter's n, not a variable of main
    ("def main():\n    def make_counter():\n        n = 0\n        def bump():\n            nonlocal n\n"
     "            n += 1\n            return n\n        return bump\n    bump = make_counter()\n"
     "    for i in range(5):\n        print(i, bump())\n", ""),
    ("def main():\n    n = 0\n    def bump():\n        nonlocal n\n        n += 1\n    for i in range(5):\n"
     "        bump()\n", "a nested function rebinds `nonlocal n`"),
])
def test_only_variables_a_closure_really_shares_keep_a_function_unchanged(code, reason):
    assert not_rewritable(ast.parse(code).body[0]) == reason



def test_a_function_whose_loops_get_no_safe_points_is_named_with_the_reason_at_start():
    """The ``interruptible`` event names it: such a job cannot be preempted inside its loops."""
    from backend.proxy.engine import interruptible

    src = ("def f():\n    lr = 1.0\n    decay = lambda: lr * 0.5\n    for i in range(3):\n        lr = decay()\n"
           "    return sorted(locals())\nprint(f())\n")
    report = interruptible.report(ResumableProgram.from_source(src, "<f>"))
    assert [(m["line"], m["function"]) for m in report["not_safe_points"]] == [(4, "f")]
    assert "a closure shares lr" in report["not_safe_points"][0]["why"]
    assert "(it calls locals()" in report["not_safe_points"][0]["why"]


CALLABLE_TRAINER = """
import torch

class Trainer:
    def __init__(self, lr):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def __call__(self, epochs):                  # the training loop in __call__
        x, y = torch.randn(16, 3), torch.randn(16, 1)
        for epoch in range(epochs):
            loss = ((self.model(x) - y) ** 2).mean()
            self.opt.zero_grad(); loss.backward(); self.opt.step()
            print(epoch, loss.item().hex())
        return loss.item()

def main():
    train = Trainer(0.1)
    print("final", train(6))

main()
"""


def test_a_loop_in_the_dunder_call_of_an_instance_has_safe_points(launcher, tmp_path):
    """``train(6)`` where ``train`` is an instance: the restore could not call it again, so the
    loop in its ``__call__`` had no safe point (stops waited for the loop's end)."""
    script = tmp_path / "callable.py"
    script.write_text(CALLABLE_TRAINER)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    assert len(loops) >= 6
    out, runs = run_chain(launcher, [str(script)], [loops[1], loops[4]], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()
