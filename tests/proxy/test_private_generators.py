"""Randomness a loop's iterator draws from generator objects of the program's own, and the order
of sets of strings: a restore (a new process) replays the iterator from the loop's start, so both
must be as they were then, or the restore must refuse.

Shapes from real scripts that resumed wrongly, silently, before: a generator function shuffling
with a module-level ``np.random.default_rng(0)``; a custom ``Sampler`` keeping ``self.rng``;
``for name in {"embed", "head", ...}`` restored in a process with another string-hash salt."""
from __future__ import annotations

import os
import textwrap

import pytest

from harness import EXIT_PREEMPTED, ROOT, assert_chains_match, assert_resumes_at_iterations, run_chain, trace_of

PRIVATE_RNG_GENERATOR = """
import random
import numpy as np
import torch
rng = np.random.default_rng(0)
py = random.Random(1)
data = torch.arange(20.0)

def minibatches(n):
    order = rng.permutation(n)       # drawn before the first item, from the program's own generator
    py.shuffle(extra := list(range(3)))
    for i in range(0, n, 4):
        yield data[order[i:i + 4]], extra

for epoch in range(3):
    for x, extra in minibatches(20):
        print(epoch, x.tolist(), extra, rng.random())   # the loop body draws from it too
"""

CUSTOM_SAMPLER = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

class Shuffled(Sampler):
    def __init__(self, n, kind):
        self.n, self.kind = n, kind
        self.rng = {"torch": torch.Generator().manual_seed(3), "numpy": np.random.default_rng(3),
                    "python": random.Random(3)}[kind]
    def __iter__(self):
        if self.kind == "torch":
            return iter(torch.randperm(self.n, generator=self.rng).tolist())
        if self.kind == "numpy":
            return iter(self.rng.permutation(self.n).tolist())
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)
    def __len__(self):
        return self.n

ds = TensorDataset(torch.arange(12.0))
loader = DataLoader(ds, batch_size=3, sampler=Shuffled(12, KIND))
for epoch in range(3):
    for (x,) in loader:
        print(epoch, x.tolist())
"""

INTERLEAVED = """
import numpy as np
rng = np.random.default_rng(0)

def noisy(n):
    for i in range(n):
        yield i + rng.random()       # a draw per item

for epoch in range(2):
    for v in noisy(6):
        print(epoch, v, rng.random())   # and the loop body draws from the same generator
"""

SET_OF_STRINGS = """
groups = {"embed", "encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "head", "norm"}
done = []
for name in groups:
    done.append(name)
    print("tuned", name)
print("each once:", sorted(done) == sorted(groups), len(done))
"""


def _script(tmp_path, src: str, **names: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, value in names.items():
        src = src.replace(name, value)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(src))
    return [str(script)]


def _stops_resume_exactly(launcher, target, tmp_path, seeds=(1, 2)) -> None:
    base, trace = trace_of(launcher, target, tmp_path)
    assert_chains_match(launcher, target, base, trace, tmp_path, seeds, extra=2)


def test_a_generator_function_drawing_from_the_programs_own_generators_resumes_exactly(launcher, tmp_path):
    _stops_resume_exactly(launcher, _script(tmp_path, PRIVATE_RNG_GENERATOR), tmp_path)


@pytest.mark.parametrize("kind", ["torch", "numpy", "python"])
def test_a_custom_sampler_with_a_generator_of_its_own_resumes_exactly(launcher, tmp_path, kind):
    _stops_resume_exactly(launcher, _script(tmp_path, CUSTOM_SAMPLER, KIND=repr(kind)), tmp_path)


# The same generator inside main(): not rewritten (generator_rewrite.py), so a restore replays it
INTERLEAVED_NESTED = """
import numpy as np
rng = np.random.default_rng(0)

def main():
    def noisy(n):
        for i in range(n):
            yield i + rng.random()
    for epoch in range(2):
        for v in noisy(6):
            print(epoch, v, rng.random())

main()
"""


def test_a_generator_drawing_between_the_loop_bodys_draws_is_saved_where_it_stopped(launcher, tmp_path):
    _stops_resume_exactly(launcher, _script(tmp_path, INTERLEAVED), tmp_path, seeds=(1,))


def test_draws_interleaved_between_the_iterator_and_the_loop_body_are_refused(launcher, tmp_path):
    target = _script(tmp_path, INTERLEAVED_NESTED)
    stopped = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", "9"])  # 4th item
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    restored = launcher.run(target + ["--checkpoint-dir", str(tmp_path / "ck"), "--restore"])
    assert restored.rc == 2 and restored.stdout == "", restored.describe()
    assert "Generator objects the loop body drew from too" in restored.stderr, restored.stderr


def test_a_set_of_strings_iterates_in_the_same_order_after_a_restore_in_a_fresh_interpreter(fresh_launcher, tmp_path):
    """Every run starts as a new interpreter, with no PYTHONHASHSEED of its own: the engine fixes one."""
    target = _script(tmp_path, SET_OF_STRINGS)
    env = {"PYTHONHASHSEED": ""}  # empty: as if unset (python then salts at random)
    base = fresh_launcher.run(target + ["--checkpoint-dir", str(tmp_path / "base")], env)
    assert base.rc == 0, base.describe()
    out, _ = run_chain(fresh_launcher, target, [3, 6], tmp_path / "ck", env)
    assert out == base.stdout and "each once: True 8" in out


def test_a_restore_under_another_string_hash_salt_is_refused_naming_it(fresh_launcher, tmp_path):
    target = _script(tmp_path, SET_OF_STRINGS)
    ck = str(tmp_path / "ck")
    stopped = fresh_launcher.run(target + ["--checkpoint-dir", ck, "--stop-at-step", "3"], {"PYTHONHASHSEED": "5"})
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    refused = fresh_launcher.run(target + ["--checkpoint-dir", ck, "--restore"], {"PYTHONHASHSEED": "7"})
    assert refused.rc == 2 and refused.stdout == "", refused.describe()
    assert "string hashing (PYTHONHASHSEED 7 here)" in refused.stderr, refused.stderr
    resumed = fresh_launcher.run(target + ["--checkpoint-dir", ck, "--restore"], {"PYTHONHASHSEED": "5"})
    assert resumed.rc == 0 and "each once: True 8" in stopped.stdout + resumed.stdout, resumed.describe()


def test_a_relative_checkpoint_folder_is_where_the_command_ran_though_the_script_changes_folder(fresh_launcher, tmp_path):
    (tmp_path / "out").mkdir()
    target = _script(tmp_path, f"import os\nos.chdir({str(tmp_path / 'out')!r})\nfor i in range(6):\n    print(i)\n")
    relative = os.path.relpath(tmp_path / "ck", ROOT)  # the launcher runs commands in ROOT
    stopped = fresh_launcher.run(target + ["--checkpoint-dir", relative, "--stop-at-step", "3"])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    assert (tmp_path / "ck").is_dir() and not (tmp_path / "out" / relative).exists()
    resumed = fresh_launcher.run(target + ["--checkpoint-dir", relative, "--restore"])
    assert resumed.rc == 0 and "[proxy] restore {" in resumed.stderr, resumed.describe()
    assert (stopped.stdout + resumed.stdout).split() == [str(i) for i in range(6)]


GLOBAL_GENERATOR_ALIASES = """
import random
from random import shuffle, randint
import numpy as np
from numpy.random import rand

class Seeded(random.Random):                      # a subclass whose __init__ takes the seed
    def __init__(self, seed):
        super().__init__(seed)
        self.draws = 0

random.seed(0)
np.random.seed(0)
legacy = np.random.mtrand._rand
mine = Seeded(7)
order = list(range(6))
for i in range(6):
    shuffle(order)                               # methods of the modules' own generators
    mine.draws += 1
    print(i, order, randint(0, 99), random.random().hex(), rand().hex(), legacy.randint(9),
          np.random.rand().hex(), mine.random().hex(), mine.draws)
"""


def test_functions_imported_from_random_and_numpy_random_draw_from_the_restored_generators(launcher, tmp_path):
    """``from random import shuffle`` binds a method of ``random``'s own generator: pickled by value,
    it came back drawing from a copy the restore never set (silently other numbers after a restore,
    ``numpy.random.rand`` too). A ``random.Random`` subclass whose ``__init__`` takes the seed was
    checkpointed, and then its restore failed."""
    assert_resumes_at_iterations(launcher, GLOBAL_GENERATOR_ALIASES, tmp_path, [1, 3])
