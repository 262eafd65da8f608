"""In-process tests of the engine: semantics preserved, events, failures, restores."""
from __future__ import annotations

import concurrent.futures
import contextlib
import io
import linecache
import random
import threading
import time
import traceback
import warnings

import numpy as np
import pytest
import torch

from backend.proxy import (CheckpointError, CheckpointStore, Controller, Preempted, ResumableProgram,
                           SOURCE_ATTR)
from backend.proxy.engine import controller as controller_module

SNIPPETS = {
    "break_else": """
for i in range(5):
    if i == 3:
        break
    print(i)
else:
    print("no break")
for j in range(2):
    print(j)
else:
    print("else ran")
""",
    "continue_while_else": """
n = 0
while n < 5:
    n += 1
    if n % 2:
        continue
    print(n)
else:
    print("done", n)
""",
    "nested_try": """
try:
    for i in range(3):
        try:
            if i == 1:
                raise ValueError(i)
            print("ok", i)
        except ValueError as e:
            print("caught", e)
except Exception:
    print("outer")
finally:
    print("fin")
""",
    "bare_except_in_loop": """
for i in range(3):
    try:
        for k in range(2):
            1 / (i - 1)
            print(i, k)
    except:
        print("bare", i)
""",
    "with_two_managers": """
import contextlib
@contextlib.contextmanager
def cm(name):
    print("enter", name)
    yield name.upper()
    print("exit", name)
with cm("a") as A, cm("b") as B:
    for i in range(2):
        print(A, B, i)
""",
    "elif_chain": """
for x in [1, 5, 10]:
    if x < 3:
        for k in range(1): print("small", x)
    elif x < 7:
        for k in range(2): print("mid", x, k)
    else:
        print("big", x)
""",
    "shadowed_enumerate": """
import builtins
def enumerate(x):
    return [("shadow", v) for v in x]
for a in enumerate([1, 2]):
    print(a)
for i, (a, b) in builtins.enumerate(zip("ab", "cd"), 5):
    print(i, a, b)
for q in iter([7, 8]):
    print(q)
""",
    "iterators": """
data = [3, 1, 2]
for v in (x * 2 for x in sorted(data)):
    print(v)
for v in map(str, data):
    print(v)
it = iter(data)
next(it)
for v in it:
    print("rest", v)
""",
    "class_body_and_comprehensions": """
class A:
    items = [i for i in range(3)]
    for q in range(2):
        pass
print(A.items, A.q)
print([[j for j in range(i)] for i in range(3)])
""",
    "global_in_function": """
counter = 0
def inc():
    global counter
    counter += 1
for _ in range(3):
    inc()
print(counter)
""",
    "targets": """
d = {"a": 1, "b": 2}
for k, v in d.items():
    print(k, v)
for (a, b), c in [((1, 2), 3)]:
    print(a, b, c)
class O: pass
o = O()
for o.attr in range(2):
    print(o.attr)
""",
    "walrus_while": """
vals = [1, 2, 3]
while (n := len(vals)) > 0:
    print(vals.pop(), n)
""",
    "future_docstring_annotations": '''
"""doc"""
from __future__ import annotations
def f(x: Undefined) -> int:
    return 1
for i in range(2):
    tmp = i
    del tmp
print(f(1), __doc__)
''',
}


def _store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck")


def run_plain(src: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(src, "<plain>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def run_engine(program: ResumableProgram, controller: Controller, ns=None, restore=None):
    out = io.StringIO()
    ns = {} if ns is None else ns
    result = preempted = None
    with contextlib.redirect_stdout(out):
        try:
            result = program.run(ns, controller, restore=restore)
        except Preempted as p:
            preempted = p
    return out.getvalue(), result, preempted, ns


def scramble_rngs() -> None:
    """Make the global generators differ, as they would in a new process."""
    random.seed(time.time_ns())
    np.random.seed(time.time_ns() % 2**32)
    torch.manual_seed(time.time_ns())


def stop_then_resume(src: str, steps: list[int], tmp_path) -> str:
    """Stop at each step in turn and restore into a fresh namespace; returns all output."""
    store = _store(tmp_path)
    text, ref = "", None
    for step in steps:
        if ref is not None:
            scramble_rngs()
        ctl = Controller(store)
        ctl.checkpoint_at_step(step, "stop")
        out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl, restore=ref)
        assert preempted is not None, f"no stop at {step}"
        text += out
        ref = preempted.checkpoint
    scramble_rngs()
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), Controller(store), restore=ref)
    assert preempted is None
    return text + out


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_rewritten_code_behaves_like_plain_python(name, tmp_path):
    src = SNIPPETS[name]
    out, _, _, ns = run_engine(ResumableProgram.from_source(src), Controller(_store(tmp_path)))
    assert out == run_plain(src)
    assert not [k for k in ns if k.startswith("__sg_")]


def test_result_is_the_last_expression(tmp_path):
    ctl = Controller(_store(tmp_path))
    assert run_engine(ResumableProgram.from_source("x = 3\nfor i in range(2):\n    x += i\nx * 2"), ctl)[1] == 8
    assert run_engine(ResumableProgram.from_source("x = 3\ny = x"), ctl)[1] is None


def test_tracebacks_point_into_the_submitted_source(tmp_path):
    src = "x = 1\ndef f(v):\n    return 1 / v\nfor i in range(3):\n    y = f(i - 2 + x)\n"
    program = ResumableProgram.from_source(src, "<cell-7>")
    with pytest.raises(ZeroDivisionError) as info:
        program.run({}, Controller(_store(tmp_path)))
    frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_tb(info.tb) if f.filename == "<cell-7>"]
    assert frames == [("<cell-7>", 5, "y = f(i - 2 + x)"), ("<cell-7>", 3, "return 1 / v")]
    assert linecache.getline("<cell-7>", 3).strip() == "return 1 / v"
    with pytest.raises(SyntaxError) as syn:
        ResumableProgram.from_source("for i in range(3:\n    pass\n", "<cell-8>")
    assert syn.value.filename == "<cell-8>" and syn.value.lineno == 1


def test_resume_inside_nested_branches_and_functions_seeing_the_namespace(tmp_path):
    src = """
import random
random.seed(5)
scale = 1
def scaled(v):
    return v * scale
class Box:
    def __init__(self):
        self.items = []
    def add(self, v):
        self.items.append(scaled(v))
box = Box()
go = True
if go:
    for i in range(3):
        go = False
        with open(__file__ if False else "/dev/null") as fh:
            for j in range(2):
                box.add(random.random())
                print(i, j, box.items[-1], isinstance(box, Box))
scale = 10
for k in range(2):
    box.add(k)
    print("k", box.items[-1])
"""
    expected = run_plain(src)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stop_then_resume(src, [10, 12, 17, 21, 24], tmp_path) == expected
    # a file the with header opens again for reading is put back where it was: nothing to warn of
    assert not any("re-opened" in str(w.message) for w in caught)


def test_resume_inside_a_loop_whose_body_rebinds_its_target(tmp_path):
    src = """
for batch in [[1, 2, 3], [4, 5, 6]]:
    batch = [b * 10 for b in batch]
    for b in batch:
        print(b)
    print("sum", sum(batch))
"""
    assert stop_then_resume(src, [3, 8], tmp_path) == run_plain(src)


def test_loop_over_a_file_opened_by_its_with_statement(tmp_path):
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"line {i}\n" for i in range(6)))
    src = f"""
count = 0
with open({str(data)!r}) as fh:
    for line in fh:
        count += 1
        print(count, line.strip())
"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stop_then_resume(src, [4, 6], tmp_path) == run_plain(src)
    assert not any("re-opened" in str(w.message) for w in caught)  # the loop puts it back in place


def test_preemption_bypasses_user_handlers_and_finally_but_exits_context_managers(tmp_path):
    src = """
import torch
try:
    with torch.no_grad():
        for i in range(5):
            print("step", i)
except BaseException:
    print("handler saw it")
finally:
    print("finally ran")
"""
    ctl = Controller(_store(tmp_path))
    ctl.checkpoint_at_step(4, "stop")
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert preempted is not None and preempted.checkpoint.step == 4
    assert "handler saw it" not in out and "finally ran" not in out
    assert torch.is_grad_enabled()  # the with statement's __exit__ ran
    rest, _, again, _ = run_engine(ResumableProgram.from_source(src), Controller(_store(tmp_path)),
                                   restore=preempted.checkpoint)
    assert again is None and out + rest == run_plain(src)


def test_checkpoint_requested_from_another_thread_emits_events(tmp_path, monkeypatch):
    monkeypatch.setattr(controller_module, "PROGRESS_INTERVAL_S", 0.02)
    events: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def on_event(kind, data):
        with lock:
            events.append((kind, data))

    src = "import time\ntotal = 0\nfor i in range(40):\n    time.sleep(0.005)\n    total += i\ntotal"
    ctl = Controller(_store(tmp_path), on_event=on_event)
    threading.Timer(0.05, ctl.request_checkpoint, kwargs={"reason": "test"}).start()
    out, result, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert result == sum(range(40)) and preempted is None
    kinds = [k for k, _ in events]
    assert kinds.index("checkpoint_started") < kinds.index("checkpointed")
    started = next(d for k, d in events if k == "checkpoint_started")
    assert started["reason"] == "test" and started["then"] == "continue"
    done = next(d for k, d in events if k == "checkpointed")
    assert done["bytes"] > 0 and 0 <= done["wait_s"] < 1 and done["rebuilt"] == []
    assert (tmp_path / "ck" / f"ckpt-{done['step']:08d}" / "manifest.json").exists()
    progress = [d for k, d in events if k == "progress"]
    assert progress and all(len(d["loops"]) == 1 for d in progress)
    steps = [d["step"] for d in progress]
    assert steps == sorted(steps)


HIDDEN_STATE = """
def gen():
    yield from range(6)
it = gen()
first = next(it)
for x in it:
    print(x)
"""


def test_iterating_hidden_state_fails_loudly_and_the_program_continues(tmp_path):
    """A generator outside the shape generator_rewrite.py covers (it uses the value of its yield)."""
    events = []
    src = HIDDEN_STATE.replace("    yield from range(6)", "    for i in range(6):\n        sent = yield i\n"
                                                         "        if sent:\n            print(sent)")
    ctl = Controller(_store(tmp_path), on_event=lambda k, d: events.append((k, d)))
    ctl.checkpoint_at_step(5, "stop")
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert preempted is None and out == run_plain(src)
    failed = [d for k, d in events if k == "checkpoint_failed"]
    assert len(failed) == 1 and ["it", "generator"] in failed[0]["variables"]
    assert "hidden" in failed[0]["error"] and "line 9" in failed[0]["error"]


def test_iterating_a_generator_of_the_rewritten_shape_resumes_exactly(tmp_path):
    ctl = Controller(_store(tmp_path))
    ctl.checkpoint_at_step(5, "stop")
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(HIDDEN_STATE), ctl)
    assert preempted is not None
    rest, _, _, _ = run_engine(ResumableProgram.from_source(HIDDEN_STATE), Controller(_store(tmp_path)),
                               restore=preempted.checkpoint)
    assert out and rest and out + rest == run_plain(HIDDEN_STATE)


def test_rebuild_is_refused_when_the_creating_statement_read_a_changed_name(tmp_path):
    events = []
    src = """
import concurrent.futures
kind = concurrent.futures.ThreadPoolExecutor
pool = kind(1)
kind = concurrent.futures.ProcessPoolExecutor
for i in range(3):
    print(i)
"""
    ctl = Controller(_store(tmp_path), on_event=lambda k, d: events.append((k, d)))
    ctl.checkpoint_at_step(6, "stop")
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert preempted is None
    failed = [d for k, d in events if k == "checkpoint_failed"]
    assert failed and failed[0]["variables"] == [["pool", "ThreadPoolExecutor"]]


def test_generator_whose_items_draw_random_numbers_is_refused_at_the_checkpoint_and_runs_on(tmp_path):
    """Its replay would be refused at restore (the draws interleave with the body's), after the
    job had stopped: the checkpoint is refused instead, naming the loop, and the program runs on."""
    events = []
    src = """
import random
random.seed(0)
def main():
    def noisy():   # nested: not rewritten, so a restore would replay it
        for i in range(6):
            yield random.random()
    for v in noisy():
        print(v, random.random())
main()
"""
    ctl = Controller(_store(tmp_path), on_event=lambda k, d: events.append((k, d)))
    ctl.checkpoint_at_step(7, "stop")
    out, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert preempted is None and out == run_plain(src)
    failed = [d for k, d in events if k == "checkpoint_failed"]
    assert failed and "whose items drew random numbers after the first" in failed[0]["error"], failed


def test_generator_drawing_only_late_is_refused_at_restore(tmp_path):
    """Draws that begin after the items the checkpoint watches are still caught by the replay."""
    src = """
import random
random.seed(0)
def main():
    def noisy():
        for i in range(9):
            yield random.random() if i >= 5 else i
    for v in noisy():
        print(v, random.random())
main()
"""
    ctl = Controller(_store(tmp_path))
    ctl.checkpoint_at_step(10, "stop")
    _, _, preempted, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert preempted is not None
    with pytest.raises(CheckpointError, match="interleaved"):
        run_engine(ResumableProgram.from_source(src), Controller(_store(tmp_path)), restore=preempted.checkpoint)


def test_restore_into_a_different_program_is_refused(tmp_path):
    ctl = Controller(_store(tmp_path))
    ctl.checkpoint_at_step(2, "stop")
    _, _, preempted, _ = run_engine(ResumableProgram.from_source("for i in range(3):\n    pass\n"), ctl)
    with pytest.raises(CheckpointError, match="different program"):
        ResumableProgram.from_source("for i in range(4):\n    pass\n").run(
            {}, Controller(_store(tmp_path)), restore=preempted.checkpoint)


def test_loops_in_called_functions_are_safe_points_unless_a_library_frame_stands_between(tmp_path):
    steps = []
    src = """
def work():
    for i in range(3):
        pass
def key(v):
    for i in range(2):
        pass
    return -v
for k in range(2):
    work()
    print(sorted([1, 2], key=key))
"""
    ctl = Controller(_store(tmp_path))
    ctl.trace_safe_points(lambda step, pos: steps.append(pos))
    out, _, _, _ = run_engine(ResumableProgram.from_source(src), ctl)
    assert out == run_plain(src)
    # per k: its own safe point, then work()'s 3 iterations and its last next(); key() runs
    # under sorted(), a library frame, so its loop is no safe point a checkpoint can use
    assert [(p["kind"], p.get("functions")) for p in steps] == \
        [("boundary", None)] * 2 + ([("loop", None)] + [("loop", ["work"])] * 4) * 2 + [("loop", None)]


def test_dataloaders_with_generators_zip_and_iterable_datasets_resume_exactly(tmp_path):
    src = """
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
torch.manual_seed(0)
g = torch.Generator()
g.manual_seed(3)
a = DataLoader(TensorDataset(torch.arange(12.)), batch_size=3, shuffle=True, generator=g)
b = DataLoader(TensorDataset(torch.arange(100., 112.)), batch_size=3, shuffle=True)
class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))
for epoch in range(2):
    for i, ((x,), (y,)) in enumerate(zip(a, b)):
        print(epoch, i, x.tolist(), y.tolist(), torch.rand(1).item())
    for s in DataLoader(Stream(), batch_size=2):
        print("stream", s.tolist())
"""
    expected = run_plain(src)
    assert stop_then_resume(src, [11, 17, 23, 27], tmp_path) == expected


def _callable_program(fn, *args, **kwargs) -> ResumableProgram:
    return ResumableProgram.from_callable(fn, args, kwargs)


def test_callable_semantics_and_resume(tmp_path):
    offset = 100

    def job(n, start=0, *, label="run"):
        """docstring kept"""
        total = start
        for i in range(n):
            if i == 4:
                return label, total + offset
            total += i + random.random()
            print(label, i, round(total, 9))
        return label, total

    random.seed(1)
    plain_out = io.StringIO()
    with contextlib.redirect_stdout(plain_out):
        expected = job(6, 1, label="x")
    program = _callable_program(job, 6, 1, label="x")
    assert program.has_safe_points and program.fallback_reason == ""
    random.seed(1)
    store = _store(tmp_path)
    ctl = Controller(store)
    ctl.checkpoint_at_step(3, "stop")
    out1, _, preempted, _ = run_engine(program, ctl)
    assert preempted is not None
    scramble_rngs()
    resumer = Controller(store)
    out2, result, again, _ = run_engine(_callable_program(job, 6, 1, label="x"), resumer,
                                        restore=preempted.checkpoint)
    assert again is None and result == expected and out1 + out2 == plain_out.getvalue()
    assert resumer.last_restore is not None and resumer.last_restore["step"] == 3


@pytest.mark.parametrize("stop", [2, 4, 6])
def test_a_callable_whose_closures_read_its_loop_variable_resumes_exactly(tmp_path, stop):
    """Its frame is rebuilt with new cells, and restored closures kept the old ones: hooks made
    before the stop went on returning the step of the checkpoint after the restore, silently."""
    def job(n):
        hooks, total = [], 0

        def bump(k):
            nonlocal total
            total += k
            return total

        for step in range(n):
            hooks.append(lambda: step)  # late binding: every hook returns the newest step
            print(step, bump(step), [h() for h in hooks])
        return [h() for h in hooks], total

    plain_out = io.StringIO()
    with contextlib.redirect_stdout(plain_out):
        expected = job(6)
    program = _callable_program(job, 6)
    assert program.has_safe_points and program.fallback_reason == ""
    ctl = Controller(_store(tmp_path))
    ctl.checkpoint_at_step(stop, "stop")
    out1, _, preempted, _ = run_engine(program, ctl)
    assert preempted is not None
    out2, result, again, _ = run_engine(_callable_program(job, 6), Controller(_store(tmp_path)),
                                        restore=preempted.checkpoint)
    assert again is None and (out1 + out2, result) == (plain_out.getvalue(), expected)


def test_a_callable_whose_shared_variables_cannot_move_runs_unchanged_and_says_why():
    def job(n):
        lr = 1.0
        decay = lambda: lr * 0.5  # noqa: E731
        for _ in range(n):
            lr = decay()
        return sorted(locals())

    reason = _callable_program(job, 3).fallback_reason
    assert reason.startswith("a closure shares lr, which the function rebinds (it calls locals()"), reason


def test_callable_local_thread_pool_is_rebuilt(tmp_path):
    def job(n):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        acc = []
        for i in range(n):
            acc.append(pool.submit(pow, i, 2).result())
        return acc, type(pool).__name__

    events = []
    ctl = Controller(_store(tmp_path), on_event=lambda k, d: events.append((k, d)))
    ctl.checkpoint_at_step(5, "stop")
    _, _, preempted, _ = run_engine(_callable_program(job, 6), ctl)
    assert preempted is not None
    assert [d["rebuilt"] for k, d in events if k == "checkpointed"] == [["pool"]]
    _, result, _, _ = run_engine(_callable_program(job, 6), Controller(_store(tmp_path)),
                                 restore=preempted.checkpoint)
    assert result == ([0, 1, 4, 9, 16, 25], "ThreadPoolExecutor")


def test_method_callable_and_attached_source(tmp_path):
    class Trainer:
        def __init__(self):
            self.seen = []

        def fit(self, n):
            for i in range(n):
                self.seen.append(i)
            return sum(self.seen)

    trainer = Trainer()
    program = ResumableProgram.from_callable(trainer.fit, (4,))
    assert program.has_safe_points
    assert run_engine(program, Controller(_store(tmp_path)))[1] == 6

    ns: dict = {}
    exec("def made(n):\n    out = []\n    for i in range(n):\n        out.append(i * i)\n    return out\n", ns)
    made = ns["made"]
    assert ResumableProgram.from_callable(made).fallback_reason.startswith("its source is unavailable")
    made.__dict__[SOURCE_ATTR] = "def made(n):\n    out = []\n    for i in range(n):\n        out.append(i * i)\n    return out\n"
    program = ResumableProgram.from_callable(made, (4,))
    assert program.has_safe_points and run_engine(program, Controller(_store(tmp_path)))[1] == [0, 1, 4, 9]


def test_callables_without_safe_points_still_run_and_say_why(tmp_path):
    events = []

    def gen_fn():
        yield 1

    lam = lambda n: [i for i in range(n)]  # noqa: E731
    for fn, why in ((lam, "lambda"), (gen_fn, "generator"), (len, "not Python functions")):
        assert why in ResumableProgram.from_callable(fn).fallback_reason
    ctl = Controller(_store(tmp_path), on_event=lambda k, d: events.append((k, d)))
    asks = lambda n: ctl.request_checkpoint("stop") or [i for i in range(n)]  # noqa: E731
    with pytest.warns(RuntimeWarning, match="without safe points"):
        assert ResumableProgram.from_callable(asks, (3,)).run({}, ctl) == [0, 1, 2]
    assert [k for k, _ in events] == ["checkpoint_failed"] and "no safe points" in events[0][1]["error"]


def test_periodic_checkpoints(tmp_path):
    events = []
    src = "import time\nfor i in range(30):\n    time.sleep(0.01)\n"
    ctl = Controller(_store(tmp_path), checkpoint_every=0.05, on_event=lambda k, d: events.append((k, d)))
    run_engine(ResumableProgram.from_source(src), ctl)
    started = [d for k, d in events if k == "checkpoint_started"]
    assert len(started) >= 2 and all(d["reason"] == "periodic" for d in started)
    assert len(list((tmp_path / "ck").glob("ckpt-*"))) == 2  # keep=2


def test_safe_point_fast_path_does_not_touch_the_controller(tmp_path, monkeypatch):
    """With nothing requested, a safe point is one flag test: the controller's slow path runs only
    for the once-a-second progress tick. (Its cost is measured in bench/, not asserted here.)"""
    calls = []
    real_poll = Controller.poll
    monkeypatch.setattr(Controller, "poll", lambda self, rt: calls.append(1) or real_poll(self, rt))
    t0 = time.monotonic()
    ResumableProgram.from_source("for i in range(200000):\n    pass\n").run({}, Controller(_store(tmp_path)))
    assert len(calls) <= 1 + int(time.monotonic() - t0)
