"""A loop over a generator or iterable that cannot be pickled is resumed by creating it again and
skipping the items already taken. When the iterator reads state the loop body changes (hardest
example mining from a ``losses`` list, a curriculum level the body raises), the replay yields
other items: such a restore used to resume differently, silently. It must refuse instead, and a
replay of an iterator that only reads what the body leaves alone must still resume exactly,
through several restores (the digest of the items taken goes on after each)."""
from __future__ import annotations

import textwrap

import pytest

from harness import EXIT_PREEMPTED, assert_chains_match, pick_stops, run_chain, trace_of

HARD_EXAMPLES = """
import torch
torch.manual_seed(0)
X, y = torch.randn(32, 4), torch.randn(32)
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.05)
losses = [1.0] * 32

def hardest(steps, k=4):
    for _ in range(steps):
        yield sorted(range(32), key=lambda i: -losses[i])[:k]   # reads what the body updates

def main():
    for step, idx in enumerate(hardest(12)):
        per_example = (X[idx] @ w - y[idx]) ** 2
        for i, l in zip(idx, per_example.tolist()):
            losses[i] = l
        opt.zero_grad()
        per_example.mean().backward()
        opt.step()
        print(step, idx, round(per_example.mean().item(), 6))

main()
"""

CURRICULUM = """
class Curriculum:
    def __init__(self):
        self.level = 1
    def __iter__(self):
        for i in range(10):
            yield [i] * self.level     # the level is read as each item is made

course = Curriculum()
for item in course:
    print(item)
    if len(item) < 3 and sum(item) % 2:
        course.level += 1              # ... and raised by the loop body
"""

# An in-process IterableDataset (a DataLoader without workers replays its batches) whose length
# of sequence the body raises mid-epoch
STREAM = """
import torch
from torch.utils.data import DataLoader, IterableDataset

class Stream(IterableDataset):
    def __init__(self):
        self.max_len = 2
    def __iter__(self):
        for i in range(12):
            yield torch.arange(float(i), i + self.max_len)[:2] * self.max_len

stream = Stream()
for epoch in range(2):
    for step, batch in enumerate(DataLoader(stream, batch_size=2)):
        print(epoch, step, batch.tolist())
        if step == 2:
            stream.max_len += 1
"""

# Only what the body leaves alone decides the items: views of an array the body updates in
# place, a permutation drawn up front, parameters the optimizer moves.
UNCHANGED_CHOICE = """
import numpy as np
import torch
torch.manual_seed(0)
data = np.arange(24.0).reshape(12, 2)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def rows(a):
    for i in range(len(a)):
        yield a[i]                     # a view: the body scales it in place

def batches(n, b):
    order = torch.randperm(n)
    for i in range(0, n, b):
        yield torch.from_numpy(data[order[i:i + b].numpy()]).float()

for epoch in range(2):
    for r in rows(data):
        r *= 1.5
    for x in batches(12, 3):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        for name, p in model.named_parameters():
            p.data.mul_(0.99)
        print(epoch, x.sum().item(), round(loss.item(), 6))
print(data.sum())
"""


def _script(tmp_path, src: str) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(src))
    return [str(script)]


# The same generator defined inside main(): generator_rewrite leaves nested generators as they
# are, so the loop over it is replayed at a restore
HARD_EXAMPLES_NESTED = HARD_EXAMPLES.replace("""
def hardest(steps, k=4):
    for _ in range(steps):
        yield sorted(range(32), key=lambda i: -losses[i])[:k]   # reads what the body updates

def main():
""", """
def main():
    def hardest(steps, k=4):
        for _ in range(steps):
            yield sorted(range(32), key=lambda i: -losses[i])[:k]
""")
assert HARD_EXAMPLES_NESTED != HARD_EXAMPLES


def _stop_and_restore(launcher, tmp_path, src: str, stop: int) -> tuple:
    """The uninterrupted run, a run stopped at ``stop`` and the restore of its checkpoint."""
    target = _script(tmp_path, src)
    base = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "base")])
    assert base.rc == 0, base.describe()
    ck = str(tmp_path / "ck")
    stopped = launcher.run(target + ["--checkpoint-dir", ck, "--stop-at-step", str(stop)])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    assert base.stdout.startswith(stopped.stdout) and stopped.stdout.count("\n") >= 3, stopped.describe()
    return base, stopped, launcher.run(target + ["--checkpoint-dir", ck, "--restore"])


@pytest.mark.parametrize("src, stop", [(HARD_EXAMPLES_NESTED, 40), (STREAM, 11)],
                         ids=["hard-examples-nested", "dataloader-stream"])
def test_a_replay_that_yields_other_items_than_the_loop_took_is_refused(launcher, tmp_path, src, stop):
    _, _, restored = _stop_and_restore(launcher, tmp_path, src, stop)
    assert restored.rc == 2 and restored.stdout == "", restored.describe()
    assert "gave other items than the loop had taken" in restored.stderr, restored.stderr
    assert "reads state that changed since the loop began" in restored.stderr


def test_replays_of_iterators_that_read_only_what_the_body_leaves_alone_resume_exactly(launcher, tmp_path):
    target = _script(tmp_path, UNCHANGED_CHOICE)
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.rc == 0, base.describe()
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2), extra=3)


# An iterable whose __iter__ changes it: a restore runs __iter__ again to replay the iterator, on
# the object as the checkpoint has it (its epoch already counted, its list already shuffled).
# These resumed with another order, silently, before (red-team round 3).
EPOCH_IN_ITER = """
import random

class EpochShuffler:
    # reshuffles with a fresh per-epoch seed on every pass
    def __init__(self, items, seed=0):
        self.items, self.seed, self.epoch = list(items), seed, 0
    def __iter__(self):
        self.epoch += 1
        order = self.items[:]
        random.Random(self.seed + self.epoch).shuffle(order)
        return iter(order)

data = EpochShuffler(range(6))
for epoch in range(3):
    for x in data:
        print(epoch, data.epoch, x)
"""

SAMPLER_EPOCH_IN_ITER = """
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

class EpochSampler(Sampler):
    # a per-epoch shuffle, like DistributedSampler, but it bumps its own epoch
    def __init__(self, n, seed=0):
        self.n, self.seed, self.epoch = n, seed, 0
    def __iter__(self):
        self.epoch += 1
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())
    def __len__(self):
        return self.n

ds = TensorDataset(torch.arange(8.0))
sampler = EpochSampler(8)
loader = DataLoader(ds, batch_size=2, sampler=sampler)
for epoch in range(3):
    for (xb,) in loader:
        print(epoch, sampler.epoch, xb.tolist())
"""

SHUFFLED_IN_PLACE = """
import random

class BucketBatches:
    # batches of similar length; shuffles its own batch list on every pass
    def __init__(self, lengths, bs):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.batches = [order[i:i + bs] for i in range(0, len(order), bs)]
    def __iter__(self):
        random.shuffle(self.batches)
        return iter(self.batches)

random.seed(0)
lengths = [random.randint(1, 50) for _ in range(12)]
batches = BucketBatches(lengths, 3)
for epoch in range(3):
    for b in batches:
        print(epoch, b)
"""


@pytest.mark.parametrize("src", [EPOCH_IN_ITER, SAMPLER_EPOCH_IN_ITER, SHUFFLED_IN_PLACE],
                         ids=["epoch-in-iter", "sampler-epoch-in-iter", "shuffled-in-place"])
def test_an_iter_that_changes_its_object_is_replayed_from_the_object_as_the_loop_began(launcher, tmp_path, src):
    target = _script(tmp_path, src)
    base, trace = trace_of(launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop" and len(t["loops"]) == 2]
    for seed in (1, 2):
        stops = sorted(set(pick_stops(trace, seed, extra=2)) | {loops[len(loops) // 2]})
        out, _ = run_chain(launcher, target, stops, tmp_path / f"ck-{seed}")
        assert out == base.stdout, f"seed {seed}, stops {stops}"


# Items the program takes with next() from a file the with statement around the loop opens again:
# a header before the loop (the restore refused), two-line records in the body (the pairs came
# out misaligned, silently); lines read with readline() in a loop over something else (read again
# from the file's start, silently).
HEADER_THEN_ROWS = """
import os
HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "data.csv")
with open(path, "w") as out:
    out.write("x,y\\n")
    for i in range(6):
        out.write(f"{i},{i * i}\\n")
total = 0
with open(path) as f:
    header = next(f)
    for line in f:
        x, y = map(int, line.split(","))
        total += y
        print(header.strip(), x, y, total)
"""

TWO_LINE_RECORDS = """
import os
HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "pairs.txt")
with open(path, "w") as out:
    for i in range(4):
        out.write(f"src{i} a b\\n")
        out.write(f"tgt{i} x y\\n")
with open(path) as f:
    for src in f:
        tgt = next(f)
        for tok in src.split():
            print(src.split()[0], tgt.split()[0], tok)
"""


READLINE_IN_BODY = """
import os
HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "d.txt")
with open(path, "w") as out:
    for i in range(10):
        out.write(f"line{i}\\n")
with open(path) as f:
    first = f.readline()
    for k in range(6):
        print(k, first.strip(), f.readline().strip())
"""


@pytest.mark.parametrize("src", [HEADER_THEN_ROWS, TWO_LINE_RECORDS, READLINE_IN_BODY],
                         ids=["header", "two-line-records", "readline-in-body"])
def test_lines_taken_with_next_from_a_reopened_file_are_taken_again(launcher, tmp_path, src):
    target = _script(tmp_path, src)
    base, trace = trace_of(launcher, target, tmp_path)
    assert "tgt0" in base.stdout or "x,y 0 0 0" in base.stdout or "line0 line1" in base.stdout, base.stdout
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2, 3), extra=3)


HELPER_READS_THE_HEADER = '''
import os
from readers import read_header, next_pair

HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "rows.csv")
with open(path, "w") as out:
    out.write("x,y\\n")
    for i in range(8):
        out.write(f"{i},{i * i}\\n")

def main():
    with open(path) as f:
        cols = read_header(f)
        for line in f:
            other = next_pair(f)
            print(cols, line.strip(), other)

if __name__ == "__main__":
    main()
'''

READERS = '''
def read_header(f):
    return next(f).strip().split(",")


def next_pair(f):
    return next(f, "end").strip()
'''


def test_lines_a_helper_module_takes_with_next_are_taken_again(launcher, tmp_path):
    """``next(f)`` in a helper module beside the script (a header reader, a record's second line):
    the restore re-opened the file and was refused (other items than the loop had taken)."""
    (tmp_path / "readers.py").write_text(READERS)
    target = _script(tmp_path, HELPER_READS_THE_HEADER)
    base, trace = trace_of(launcher, target, tmp_path)
    assert "['x', 'y'] 0,0 1,1" in base.stdout, base.stdout
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2), extra=2)


# A text file held in a variable (no with statement): next() and the for loop disable its tell(),
# so every checkpoint in such a loop was refused ("its position cannot be saved").
FILE_IN_A_VARIABLE = """
import os
HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "rows.txt")
with open(path, "w") as out:
    out.write("# comment\\n# another\\nname,value\\n")
    for i in range(12):
        out.write(f"r{i},{i * i}\\n")

def main():
    f = open(path)
    for line in f:                     # skip the comments, then stop at the header
        if not line.startswith("#"):
            break
    cols = line.strip().split(",")
    for line in f:                     # a second loop over the same file
        other = next(f, "end").strip()  # two rows per record
        print(cols, line.strip(), other)
    f.close()

main()
"""


READLINE_AFTER_A_LOOP = """
import os
HERE = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(HERE, "rows.txt")
with open(path, "w") as out:
    out.write("# comment\\nname,value\\n")
    for i in range(12):
        out.write(f"r{i},{i * i}\\n")
f = open(path)
for line in f:                         # the loop breaks off at the header
    if not line.startswith("#"):
        break
while True:                            # then readline(), which no loop or next() counts
    row = f.readline()
    if not row:
        break
    print(line.strip(), row.strip())
f.close()
"""


@pytest.mark.parametrize("src", [FILE_IN_A_VARIABLE, READLINE_AFTER_A_LOOP], ids=["loops-and-next", "readline-after"])
def test_a_text_file_in_a_variable_read_by_loops_and_next_resumes_where_it_was(launcher, tmp_path, src):
    target = _script(tmp_path, src)
    base, trace = trace_of(launcher, target, tmp_path)
    assert "r0,0 r1,1" in base.stdout or "name,value r0,0" in base.stdout, base.stdout
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2, 3), extra=3)


NESTED_SAMPLER_RNG = """
import numpy as np, torch
from torch.utils.data import DataLoader, Sampler

class Settings:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

class ShuffledBatches(Sampler):
    def __init__(self, n, bs, settings):
        self.n, self.bs, self.settings = n, bs, settings
    def __len__(self):
        return self.n // self.bs
    def __iter__(self):
        perm = self.settings.rng.permutation(self.n)   # the generator is one object deeper
        for i in range(0, self.n, self.bs):
            yield perm[i:i + self.bs].tolist()

loader = DataLoader(torch.arange(12), batch_sampler=ShuffledBatches(12, 3, Settings(0)))
for epoch in range(3):
    for batch in loader:
        print(epoch, batch.tolist())
"""


def test_a_sampler_whose_generator_sits_in_an_attribute_of_an_attribute_resumes_exactly(launcher, tmp_path):
    """`self.settings.rng.permutation(...)` in a batch sampler: only generators directly on the
    sampler were put back as the epoch began, so the resumed epochs were shuffled differently."""
    target = _script(tmp_path, NESTED_SAMPLER_RNG)
    base, trace = trace_of(launcher, target, tmp_path)
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2, 3), extra=3)


GENERATOR_DOING_THE_STEP = """
import torch
torch.manual_seed(0)
X = torch.randn(32, 3); Y = X.sum(1, keepdim=True)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

def training_steps(n):
    for step in range(n):
        i = (step * 4) % 32
        loss = (model(X[i:i + 4]) - Y[i:i + 4]).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()   # the work is done inside the generator
        yield step

for step in training_steps(30):
    print(step, f"{model.weight.sum().item():.7f}")
"""

# The same inside main(): a nested generator is not rewritten (generator_rewrite.py), so a
# restore would replay it
GENERATOR_DOING_THE_STEP_NESTED = GENERATOR_DOING_THE_STEP.replace("\ndef training_steps(n):", "\ndef main():\n  def training_steps(n):") \
    .replace("\nfor step in training_steps(30):\n    print", "\n  for step in training_steps(30):\n    print") + "\nmain()\n"


def test_a_generator_that_does_the_training_step_is_refused_at_restore_not_replayed(launcher, tmp_path):
    """Replaying it applied the steps before the checkpoint a second time on the restored model,
    silently (its items, step numbers, were the same): the restore now refuses, naming what the
    replay changed."""
    target = _script(tmp_path, GENERATOR_DOING_THE_STEP_NESTED)
    base, trace = trace_of(launcher, target, tmp_path)
    step = [t["step"] for t in trace if t["kind"] == "loop"][12]
    stopped = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    resumed = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--restore"])
    assert resumed.rc != 0 and "changed `model`, `opt`: the generator does work as it yields" in resumed.stderr, \
        resumed.describe()
    assert base.stdout.startswith(stopped.stdout + resumed.stdout)  # nothing that differs was printed


RANDOM_STREAM = """
import torch
from torch.utils.data import IterableDataset, DataLoader

class Stream(IterableDataset):
    def __iter__(self):
        for i in range(20):
            yield torch.randn(2)        # drawn in the loader's next(), in this process

torch.manual_seed(0)
for x in DataLoader(Stream(), batch_size=2):
    print(round(x.sum().item(), 6))
"""


def test_an_in_process_stream_drawing_random_numbers_is_refused_at_the_checkpoint(launcher, tmp_path):
    """The stop used to succeed and the restore to refuse (its replay's draws cannot be
    reproduced): the job stopped for good. The checkpoint now refuses, and the job runs on."""
    target = _script(tmp_path, RANDOM_STREAM)
    base, trace = trace_of(launcher, target, tmp_path)
    step = [t["step"] for t in trace if t["kind"] == "loop"][5]
    run = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", str(step)])
    assert run.rc == 0 and run.stdout == base.stdout, run.describe()
    [failed] = [d for _, d in run.events("checkpoint_failed")]
    assert "drew random numbers after the first" in failed["error"] and "num_workers=1 or more" in failed["error"]


FRESH_ITERABLES_THAT_ADVANCE_THEMSELVES = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

class Batches:
    def __init__(self, n):
        self.n, self.served = n, 0
    def __iter__(self):
        for i in range(self.n):
            self.served += 1            # the object the loop's expression made advances itself
            yield i

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.arange(24.0)), batch_size=4, shuffle=True)
for epoch in range(2):
    for (x,) in tqdm(loader, desc=f"epoch {epoch}", leave=False):
        print(epoch, x.tolist())
    for b in Batches(5):
        print(epoch, b)
"""


def test_iterables_the_loop_makes_afresh_may_advance_themselves_in_a_replay(launcher, tmp_path):
    """The replay's check for generators doing the program's work took tqdm's bar, advanced by
    its own __iter__, for such work, and refused a job that resumes exactly."""
    target = _script(tmp_path, FRESH_ITERABLES_THAT_ADVANCE_THEMSELVES)
    base, trace = trace_of(launcher, target, tmp_path)
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds=(1, 2, 3), extra=3)


def test_a_stream_drawing_random_numbers_is_refused_at_a_checkpoint_after_a_restore(launcher, tmp_path):
    """Stopped at its first batch (accepted: only the first item drew), restored, then asked to
    stop mid-epoch: the stop used to be accepted (the restored loop's items were no longer
    watched) and its restore to refuse, failing the job. The checkpoint now refuses, as the first
    time, and the job runs on."""
    target = _script(tmp_path, RANDOM_STREAM)
    base, trace = trace_of(launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    first = launcher.run(target + ck + ["--stop-at-step", str(loops[0])])
    assert first.rc == EXIT_PREEMPTED, first.describe()
    rest = launcher.run(target + ck + ["--restore", "--stop-at-step", str(loops[5])])
    assert rest.rc == 0, rest.describe()
    assert first.stdout + rest.stdout == base.stdout
    [failed] = [d for _, d in rest.events("checkpoint_failed")]
    assert "drew random numbers after the first" in failed["error"] and "num_workers=1 or more" in failed["error"]


BY_INDEX = """
import random

class Shards:
    \"\"\"Iterated by index (``__getitem__`` and ``__len__``, no ``__iter__``), counting its loads.\"\"\"
    def __init__(self, n):
        self.n, self.loads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        self.loads += 1
        return [random.random() for _ in range(2)]

random.seed(0)
shards = Shards(12)
total = 0.0
for i, shard in enumerate(shards):
    total += sum(shard) * random.random()
    print(i, shards.loads, f"{total:.10f}", flush=True)
"""


def test_an_object_iterated_by_index_resumes_without_loading_the_items_again(launcher, tmp_path):
    """``__getitem__`` drew random numbers and counted its loads: the replay of the items already
    taken ran it again on the restored object (the count advanced twice), or was refused."""
    script = tmp_path / "by_index.py"
    script.write_text(textwrap.dedent(BY_INDEX))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert "11 12 " in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(5,))


CALLABLE_ITERATOR = """
import random

class Source:
    def __init__(self, n):
        self.left = n

    def next_batch(self):
        if self.left == 0:
            return None
        self.left -= 1
        return [random.random() for _ in range(3)]

random.seed(0)
src = Source(10)
total = 0.0
for batch in iter(src.next_batch, None):
    total += sum(batch) * random.random()
    print(src.left, f"{total:.10f}", flush=True)
"""


def test_an_iterator_restored_from_its_pickle_is_not_refused_for_its_draws_after_a_restore(launcher, tmp_path):
    """``iter(src.next_batch, None)`` pickles with ``src``: a restore does not replay it, so the
    draws of its items need no refusal; one came at the first checkpoint after a restore, telling
    the user about DataLoader workers."""
    script = tmp_path / "callable_iterator.py"
    script.write_text(textwrap.dedent(CALLABLE_ITERATOR))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(3,))


@pytest.mark.parametrize("src, stop", [(HARD_EXAMPLES, 40), (CURRICULUM, 7), (GENERATOR_DOING_THE_STEP, 20)],
                         ids=["hard-examples", "curriculum", "doing-the-step"])
def test_a_generator_of_the_program_is_saved_where_it_stopped_not_replayed(launcher, tmp_path, src, stop):
    """Module-level generators (and methods') are saved suspended (generator_rewrite.py): the
    items they make from state the body changes come out as in an uninterrupted run."""
    base, stopped, restored = _stop_and_restore(launcher, tmp_path, src, stop)
    assert restored.rc == 0 and stopped.stdout + restored.stdout == base.stdout, restored.describe()


PRINTING_WHILE_LOADING = """
import logging
import sys
import torch
from torch.utils.data import DataLoader, IterableDataset

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
log = logging.getLogger("data")


class Shards(IterableDataset):
    def __iter__(self):
        print("opening shards")
        for i in range(12):
            yield torch.tensor([float(i)])


def main():
    def batches(n):  # a generator in a function: re-created and replayed at a restore
        for s in range(n):
            log.info("load %d", s)
            yield s

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Shards(), batch_size=4)
    for epoch in range(2):
        for i, x in enumerate(loader):
            loss = (model(x) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            print(epoch, i, f"{loss.item():.6f}")
        for b in batches(4):
            print("batch", b)


main()
"""


def test_what_a_replay_prints_is_not_printed_again(launcher, tmp_path):
    """An IterableDataset's ``__iter__`` that prints, and a generator that logs before each
    ``yield``, are re-created at a restore and replayed past the items taken: their lines were
    printed a second time."""
    script = tmp_path / "shards.py"
    script.write_text(textwrap.dedent(PRINTING_WHILE_LOADING))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    lines = PRINTING_WHILE_LOADING.splitlines()
    loops = {line: [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == line]
             for line in (next(i for i, x in enumerate(lines, 1) if "in enumerate(loader)" in x),
                          next(i for i, x in enumerate(lines, 1) if "in batches(4)" in x))}
    stops = [steps[2] for steps in loops.values()] + [list(loops.values())[0][-2]]
    out, runs = run_chain(launcher, [str(script)], sorted(stops), tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()
