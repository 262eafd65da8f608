"""DataLoaders with ``persistent_workers=True``: their workers keep their random generators from
epoch to epoch, so a restore must start new workers where the old ones were (worker_rng.py).

The programs draw in ``__getitem__`` as random augmentations do (torch, python and numpy), and the
chains stop inside later epochs and between two epochs, where the loader keeps an iterator its
loop has finished. Before, a stop between epochs shuffled the next epoch otherwise (silently), and
one inside a later epoch was refused at restore or gave other augmentations."""
import textwrap

import pytest

from harness import run_chain, trace_of

AUGMENTED = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i + torch.rand(1).item() + random.random() + float(np.random.rand())


torch.manual_seed(0)
loader = DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)
for epoch in range(3):
    for x in loader:
        print(epoch, [round(v, 6) for v in x.tolist()], flush=True)
    print("epoch", epoch, torch.rand(1).item(), flush=True)
"""

DATASET_STATE = """
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info


class Jittered(Dataset):
    def __init__(self):
        self.epoch, self.calls, self.rng = 0, 0, None

    def set_epoch(self, epoch):  # in the job's copy: persistent workers never see it
        self.epoch = epoch

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.calls += 1
        return i + 100 * self.epoch + self.calls / 10 + float(self.rng.random())


def seed_worker(worker_id):  # a numpy Generator per worker, as numpy advises
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed % 2**32)


torch.manual_seed(0)
data = Jittered()
loader = DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True, worker_init_fn=seed_worker)
for epoch in range(3):
    data.set_epoch(epoch)
    for x in loader:
        print(epoch, [round(v, 6) for v in x.tolist()], flush=True)
"""

STREAM_WITH_BREAK = """
import random
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, 10, info.num_workers):
            yield i + random.random() + torch.rand(1).item()


torch.manual_seed(1)
loader = DataLoader(Stream(), batch_size=2, num_workers=2, persistent_workers=True)
for epoch in range(3):
    for i, x in enumerate(loader):
        print(epoch, i, [round(v, 6) for v in x.tolist()], flush=True)
        if epoch == 1 and i == 1:
            break
"""


ENDED_THEN_NEXT = """
import random
import time
import torch
from torch.utils.data import DataLoader, get_worker_info


def noisy(batch):
    if get_worker_info().id == 1:
        time.sleep(1.5)  # a slow worker: a restore's checkpoint comes before it loads its batch
    return [v + random.random() for v in batch]


torch.manual_seed(0)
loader = DataLoader([float(i) for i in range(6)], batch_size=2, shuffle=True, num_workers=2,
                    persistent_workers=True, collate_fn=noisy)
it = iter(loader)
for x in it:
    print("a", [round(v, 5) for v in x], flush=True)
for k in range(3):
    print("after", k, next(it, "done"), flush=True)
for x in loader:
    print("b", [round(v, 5) for v in x], flush=True)
"""

ACCELERATE = """
import random
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i + torch.rand(1).item() + random.random()])


def main():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for epoch in range(3):
        for x in loader:
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            print(epoch, [round(v, 5) for v in x.flatten().tolist()], round(loss.item(), 5), flush=True)
        print("epoch", epoch, flush=True)


if __name__ == "__main__":
    main()
"""


def _at(trace: list, *loops: int) -> int:
    """The safe point where the loop counters are ``loops``: ``(2,)`` is the top of the outer loop
    after two epochs (the kept iterator has ended), ``(3, 0)`` the inner loop's header in the third
    epoch before its first batch, ``(3, 4)`` after its fourth."""
    return next(t["step"] for t in trace if t["kind"] == "loop" and tuple(t["loops"]) == loops)


def _check(launcher, tmp_path, source: str, chains) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    for n, pick in enumerate(chains):
        stops = pick(trace)
        out, runs = run_chain(launcher, [str(script)], stops, tmp_path / f"ck{n}")
        assert out == base.stdout, f"stops {stops}\n{runs[-1].describe()}"


def test_augmentations_in_workers_resume_exactly_in_later_epochs_and_between_epochs(launcher, tmp_path):
    _check(launcher, tmp_path, AUGMENTED, [
        # inside the first epoch, then between the first two (the kept iterator has ended), then at
        # the third epoch's first batch and after it
        lambda tr: [_at(tr, 1, 3), _at(tr, 1), _at(tr, 3, 0), _at(tr, 3, 1)],
        lambda tr: [_at(tr, 2, 2), _at(tr, 2), _at(tr, 3, 4)],
    ])


def test_an_iterable_dataset_whose_loop_breaks_resumes_exactly(launcher, tmp_path):
    """The loop breaks in the second epoch with batches still in flight in the workers: the next
    epoch begins after them, so the restore replays the broken epoch from its start states."""
    _check(launcher, tmp_path, STREAM_WITH_BREAK, [
        lambda tr: [_at(tr, 2)],  # after the broken epoch
        lambda tr: [_at(tr, 2, 1), _at(tr, 3, 1)],
    ])


def test_accelerate_prepared_loader_with_persistent_workers_resumes_exactly(launcher, tmp_path):
    """accelerate's loader iterates through a generator, so a restore calls ``iter(loader)`` again
    and replays: the iterator the base loader keeps is saved as it was before the loop's epoch
    began (none in the first epoch; in later ones, the previous epoch's, ended)."""
    pytest.importorskip("accelerate")
    _check(launcher, tmp_path, ACCELERATE, [
        lambda tr: [_at(tr, 1, 3), _at(tr, 2, 2), _at(tr, 3, 0)],
        lambda tr: [_at(tr, 2), _at(tr, 3, 3)],
    ])


def test_an_ended_iterator_stays_ended_after_a_restore(launcher, tmp_path):
    """``next(it, "done")`` on the kept iterator its loop ran to the end: a restore made it anew
    with batches in flight, and ``next`` gave one of them instead of ``"done"``. A second stop
    before the next epoch carries the states the first restore set for it: the new workers' own,
    read while the slow one had not yet loaded the batch it was sent, made its next epoch differ."""
    line = textwrap.dedent(ENDED_THEN_NEXT).splitlines().index("for k in range(3):") + 1

    def after(trace: list, k: int) -> int:
        return next(t["step"] for t in trace if t["kind"] == "loop" and t["line"] == line and t["loops"] == [k])

    _check(launcher, tmp_path, ENDED_THEN_NEXT, [lambda tr: [after(tr, 0), after(tr, 2)]])


def test_the_state_of_the_workers_own_dataset_copies_resumes_too(launcher, tmp_path):
    """A Dataset's generator set by ``worker_init_fn``, a counter it keeps and the epoch
    ``set_epoch`` sets in the job (persistent workers never see it) live in the workers' copies. A
    restore's new workers started from the job's copy: the epochs after it drew other numbers,
    silently at an epoch's start, refused in its middle. The workers record those attributes with
    their generators (worker_rng.py)."""
    _check(launcher, tmp_path, DATASET_STATE, [
        lambda tr: [_at(tr, 2, 0), _at(tr, 3, 2)],
        lambda tr: [_at(tr, 1, 2), _at(tr, 2), _at(tr, 3, 0)],
    ])
