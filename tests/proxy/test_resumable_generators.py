"""Generators a training script keeps suspended in variables (``batches = cycle(loader)`` then
``next(batches)``, a method generator feeding chunks, an augmenting wrapper over a stream) used to
make every checkpoint fail. Those of the shape generator_rewrite.py covers are now saved where
they stopped, their loops' iterators with them (a DataLoader iterator with its persistent
workers' generators), and a chain of stops ends with the uninterrupted run's output; a generator
of another shape still fails the checkpoint, naming it and saying which shape would do, and the
job runs on."""
from __future__ import annotations

import textwrap

from harness import assert_chains_match, run_chain, trace_of

KEPT_GENERATORS = """
import os
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X, Y = torch.randn(64, 4), torch.randn(64, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)

def cycle(dl):
    while True:
        yield from dl

def augment(stream, noise):
    n = 0
    for x, y in stream:
        n += 1
        if n % 3 == 0:
            yield x + noise * torch.randn_like(x), y
        else:
            yield x, y

class Feeder:
    def __init__(self, data):
        self.data = data
    def chunks(self, k):
        __seen, buf = 0, []
        for x in self.data:
            buf.append(x)
            __seen += 1
            if len(buf) == k:
                yield __seen, buf
                buf = []
        if buf:
            yield __seen, buf

def records(path):
    with open(path) as f:
        header = f.readline().strip().split(",")
        for line in f:
            yield dict(zip(header, line.strip().split(",")))

def never_started():
    yield "never started"

def main():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = augment(cycle(loader), 0.01)
    chunks = Feeder(list(range(23))).chunks(3)
    idle = never_started()
    table = os.path.join(os.path.dirname(os.path.abspath(__file__)), "table.csv")
    with open(table, "w") as f:
        f.write("step,value\\n" + "".join(f"{i},{i * i}\\n" for i in range(40)))
    rows = records(table)
    for step, (x, y) in zip(range(22), stream):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, round(loss.item(), 6), next(chunks, None), next(rows))
    print(next(idle))

if __name__ == "__main__":
    main()
"""

TRY_AROUND_THE_YIELD = """
import os

def lines(path):
    f = open(path)
    try:
        for line in f:
            yield line.strip()
    finally:
        f.close()

def guarded(rows):
    for row in rows:
        try:
            yield int(row) * 2
        except ValueError:
            print("skipped", row)

def lenient(rows):
    for row in rows:
        try:
            value = int(row)
        except ValueError:
            yield "bad " + row  # a yield in an except block: not a shape a restore can walk into
        else:
            yield value

data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data.txt")
with open(data, "w") as f:
    f.write("\\n".join(str(i) for i in range(40)))
rows = lines(data)
doubled = guarded(lines(data))
for step in range(12):
    print(step, next(rows), next(doubled))
checked = lenient(["1", "x", "3"])
for step in range(3):
    print(next(checked))
"""


def _script(tmp_path, name: str, src: str) -> list[str]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(src))
    return [str(script)]


def test_generators_kept_in_variables_are_saved_where_they_stopped(launcher, tmp_path):
    target = _script(tmp_path, "train.py", KEPT_GENERATORS)
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout.splitlines()[-1] == "never started" and "(23, [21, 22])" in base.stdout \
        and "{'step': '21', 'value': '441'}" in base.stdout
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2), extra=3)


def test_a_generator_of_another_shape_fails_the_checkpoint_naming_it_and_the_job_runs_on(launcher, tmp_path):
    """A yield in the body of a ``try`` (``finally: f.close()``, ``except ValueError:``) is saved
    where it stopped; a yield in an ``except`` block is not a shape a restore can walk back into:
    a checkpoint while that generator is suspended fails, naming it, and the job runs on."""
    target = _script(tmp_path, "read.py", TRY_AROUND_THE_YIELD)
    base, trace = trace_of(launcher, target, tmp_path)
    loops = [t for t in trace if t["kind"] == "loop"]
    first_loop = [t["step"] for t in loops if t["line"] == loops[0]["line"]]
    out, _ = run_chain(launcher, target, [first_loop[1], first_loop[6], first_loop[-1]], tmp_path / "chain")
    assert out == base.stdout
    step = [t["step"] for t in loops if t["line"] != loops[0]["line"]][1]
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert run.rc == 0 and run.stdout == base.stdout, run.describe()
    [failed] = [d for _, d in run.events("checkpoint_failed")]
    assert failed["variables"] == [["checked", "generator"]], failed
    assert "generator from lenient()" in failed["error"] and "no yield in its `except`" in failed["error"]


UNSTARTED_AT_THE_FIRST_STOP = """
import sys
from tqdm import tqdm

epoch = 0

def batches(n):
    global epoch  # a global statement: a generator generator_rewrite leaves as it is
    for i in range(n):
        yield i * i
    epoch += 1

for i in tqdm(range(12), file=sys.stderr):
    print("bar", i)
for value in batches(12):
    print("gen", value, epoch)
print("epochs", epoch)
"""


def test_a_loop_stopped_before_its_first_item_keeps_its_place_at_the_next_stop(launcher, tmp_path):
    """A loop over ``tqdm(...)`` (whose ``__iter__`` is a generator of tqdm's) or over a generator
    of the program that is not rewritten, stopped at its first safe point, before any item was
    taken, then again later: the second restore started the loop again from its first item, a
    silent difference. The unstarted generator was saved as itself, and that description of the
    loop was kept after the restore, when the generator had moved on."""
    target = _script(tmp_path, "bars.py", UNSTARTED_AT_THE_FIRST_STOP)
    base, trace = trace_of(launcher, target, tmp_path)
    for line in ("bar", "gen"):
        loop_line = next(i for i, x in enumerate(UNSTARTED_AT_THE_FIRST_STOP.splitlines(), 1)
                         if x.startswith("for ") and f'"{line}"' in UNSTARTED_AT_THE_FIRST_STOP.splitlines()[i])
        steps = [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == loop_line]
        out, runs = run_chain(launcher, target, [steps[0], steps[4]], tmp_path / f"ck-{line}")
        assert out == base.stdout, runs[-1].describe()
