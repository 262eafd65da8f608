"""Complete training state: every optimizer and LR scheduler, gradients, GradScaler, SWA and live
DataLoader iterators resume exactly, in process (every class) and in fresh processes (the
reproductions of real scripts that once diverged or crashed)."""
from __future__ import annotations

import contextlib
import inspect
import io
import random
import textwrap
import time

import numpy as np
import pytest
import torch

from backend.proxy import CheckpointStore, Controller, Preempted, ResumableProgram
from harness import Launcher, pick_stops, run_chain, uninterrupted

SEEDS = (11, 23, 37)


# --------------------------------------------------------------------------- in-process helpers
def _scramble() -> None:
    random.seed(time.time_ns())
    np.random.seed(time.time_ns() % 2**32)
    torch.manual_seed(time.time_ns())


def _run(src: str, ctl: Controller, restore=None) -> tuple[str, bool, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            ResumableProgram.from_source(src).run({}, ctl, restore=restore)
            return out.getvalue(), False, None
        except Preempted as p:
            return out.getvalue(), True, p.checkpoint


def _safe_points(src: str, tmp_path) -> tuple[str, list[int]]:
    steps: list[int] = []
    ctl = Controller(CheckpointStore(tmp_path / "trace"))
    ctl.trace_safe_points(lambda step, info: steps.append(step))
    out, stopped, _ = _run(src, ctl)
    assert not stopped
    return out, steps


def assert_exact_in_process(src: str, tmp_path, seed: int, stops: int = 3) -> None:
    """Stop at ``stops`` seeded random safe points in turn, restoring each time: same output."""
    plain = io.StringIO()
    with contextlib.redirect_stdout(plain):
        exec(compile(src, "<plain>", "exec"), {"__name__": "__main__"})
    traced, steps = _safe_points(src, tmp_path)
    assert traced == plain.getvalue()
    chosen = sorted(random.Random(seed).sample(steps, min(stops, len(steps))))
    store = CheckpointStore(tmp_path / f"ck-{seed}")
    text, ref = "", None
    for step in chosen:
        ctl = Controller(store)
        ctl.checkpoint_at_step(step, "stop")
        out, stopped, ref_new = _run(src, ctl, ref)
        assert stopped, f"no stop at {step}"
        text += out
        ref = ref_new
        _scramble()
    out, stopped, _ = _run(src, Controller(store), ref)
    assert not stopped
    assert text + out == plain.getvalue(), f"stops {chosen}"


# --------------------------------------------------------------------------- every optimizer
TRAIN = """
import hashlib
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
{setup}
x = torch.randn(32, 6)
y = torch.randn(32, 4)
def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
for step in range(6):
    opt.zero_grad()
    for micro in range(2):
        loss = torch.nn.functional.mse_loss(model(x[micro::2]), y[micro::2])
        loss.backward()
    {step}
    {after}
    print(step, loss.item().hex(), [float(g["lr"]).hex() for g in opt.param_groups])
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
"""

OPTIMIZERS = {
    "Adafactor": "torch.optim.Adafactor(model.parameters(), lr=0.01)",
    "Adadelta": "torch.optim.Adadelta(model.parameters())",
    "Adagrad": "torch.optim.Adagrad(model.parameters(), lr=0.05)",
    "Adam": "torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)",
    "Adamax": "torch.optim.Adamax(model.parameters(), lr=0.01)",
    "AdamW": "torch.optim.AdamW(model.parameters(), lr=0.01)",
    "ASGD": "torch.optim.ASGD(model.parameters(), lr=0.01, t0=2)",
    "LBFGS": "torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)",
    "Muon": "torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.01)",
    "NAdam": "torch.optim.NAdam(model.parameters(), lr=0.01)",
    "RAdam": "torch.optim.RAdam(model.parameters(), lr=0.01)",
    "RMSprop": "torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9, centered=True)",
    "Rprop": "torch.optim.Rprop(model.parameters(), lr=0.01)",
    "SGD": "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)",
}


def _optimizer_classes() -> set[str]:
    return {n for n in torch.optim.__all__
            if inspect.isclass(getattr(torch.optim, n)) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and n not in ("Optimizer",)}


def test_every_optimizer_class_is_covered():
    """A torch release that adds an optimizer fails here until it has its exact-resume case."""
    assert _optimizer_classes() - {"SparseAdam"} <= set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_resumes_exactly(name, tmp_path):
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{name}")
    step = "opt.step(closure)" if name == "LBFGS" else "opt.step()"
    src = TRAIN.format(setup=f"opt = {OPTIMIZERS[name]}", step=step, after="")
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed)


def test_sparse_adam_resumes_exactly(tmp_path):
    src = """
import torch
torch.manual_seed(0)
emb = torch.nn.Embedding(20, 4, sparse=True)
opt = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
for step in range(6):
    opt.zero_grad()
    idx = torch.randint(0, 20, (8,))
    loss = emb(idx).pow(2).sum()
    loss.backward()
    opt.step()
    print(step, loss.item().hex())
print(emb.weight.sum().item().hex())
"""
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed)


# --------------------------------------------------------------------------- every scheduler
SCHEDULERS = {
    "LambdaLR": "S.LambdaLR(opt, lambda e: 0.9 ** e)",
    "MultiplicativeLR": "S.MultiplicativeLR(opt, lambda e: 0.95)",
    "StepLR": "S.StepLR(opt, step_size=2, gamma=0.5)",
    "MultiStepLR": "S.MultiStepLR(opt, milestones=[1, 4], gamma=0.3)",
    "ConstantLR": "S.ConstantLR(opt, factor=0.5, total_iters=3)",
    "LinearLR": "S.LinearLR(opt, start_factor=0.2, total_iters=4)",
    "ExponentialLR": "S.ExponentialLR(opt, gamma=0.8)",
    "SequentialLR": "S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.5, total_iters=2), "
                    "S.ExponentialLR(opt, gamma=0.9)], milestones=[2])",
    "CosineAnnealingLR": "S.CosineAnnealingLR(opt, T_max=5)",
    "ChainedScheduler": "S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=3), "
                        "S.ExponentialLR(opt, gamma=0.9)])",
    "ReduceLROnPlateau": "S.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)",
    "CyclicLR": "S.CyclicLR(opt, base_lr=0.001, max_lr=0.1, step_size_up=2, mode='exp_range', gamma=0.9)",
    "CosineAnnealingWarmRestarts": "S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2)",
    "OneCycleLR": "S.OneCycleLR(opt, max_lr=0.1, total_steps=10)",
    "PolynomialLR": "S.PolynomialLR(opt, total_iters=5, power=2.0)",
    "SWALR": "torch.optim.swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=3)",
}


def test_every_scheduler_class_is_covered():
    import torch.optim.lr_scheduler as S

    classes = {n for n in S.__all__ if inspect.isclass(getattr(S, n))} - {"LRScheduler"}
    assert classes <= set(SCHEDULERS)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_resumes_exactly(name, tmp_path):
    setup = ("import torch.optim.lr_scheduler as S\nimport torch.optim.swa_utils\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)\n"
             f"sched = {SCHEDULERS[name]}")
    after = "sched.step(loss.item())" if name == "ReduceLROnPlateau" else "sched.step()"
    src = TRAIN.format(setup=setup, step="opt.step()", after=after)
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed)


def test_swa_averaged_model_and_grad_scaler_resume_exactly(tmp_path):
    """SWA's AveragedModel and a GradScaler whose scale has grown and backed off."""
    setup = ("from torch.optim.swa_utils import AveragedModel, SWALR\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
             "swa = AveragedModel(model)\n"
             "scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10, growth_interval=2)")
    src = TRAIN.format(setup=setup, step="scaler.step(opt); scaler.update(); swa.update_parameters(model)",
                       after="print(scaler.get_scale(), swa.n_averaged.item())")
    src = src.replace("        loss.backward()", "        scaler.scale(loss).backward()")
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed)


def test_grad_scaler_between_step_and_update_resumes_exactly(tmp_path):
    """A safe point after scaler.step() but before update(): its per-optimizer state is kept."""
    src = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 16, growth_interval=1)
x = torch.randn(16, 4)
for step in range(5):
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean() * (1e30 if step == 2 else 1.0)).backward()
    scaler.step(opt)
    for group in opt.param_groups:
        print(step, group["lr"])
    scaler.update()
    print(step, scaler.get_scale(), model.weight.sum().item().hex())
"""
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed, stops=4)


# --------------------------------------------------------------------------- fresh processes
@pytest.fixture(scope="module")
def launcher():
    lau = Launcher()
    yield lau
    lau.close()


GRAD_ACCUMULATION = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randn(64, 2)
for step in range(12):
    loss = ((model(x[step * 4:step * 4 + 4]) - y[step * 4:step * 4 + 4]) ** 2).mean()
    loss.backward()
    if step % 4 == 3:
        opt.step()
        opt.zero_grad()
    print(step, loss.item().hex())
for step in range(5):
    loss = model(x).pow(2).mean()
    loss.backward()
    for k in range(2):  # a hand-written update reads .grad after a safe point
        for p in model.parameters():
            p.data.add_(-0.01 * p.grad)
    model.zero_grad()
    print("manual", loss.item().hex())
"""

LBFGS_CLOSURE = """
import torch
torch.manual_seed(1)
x = torch.linspace(-1, 1, 40).unsqueeze(1)
y = torch.sin(3 * x)
model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5)
for i in range(8):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    loss = opt.step(closure)
    print(i, loss.item().hex())
"""

ITERATOR_HOLDER = """
import torch
from torch.utils.data import DataLoader, TensorDataset

class Infinite:
    def __init__(self, ds, **kw):
        self.loader = DataLoader(ds, batch_size=4, shuffle=True, **kw)
        self.it = iter(self.loader)
    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

class Noisy(torch.utils.data.Dataset):  # the program's own class, reading its globals in workers
    def __len__(self):
        return 24
    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.randn(()) * SCALE

SCALE = 2.0
torch.manual_seed(0)
ds = TensorDataset(torch.arange(24.0).unsqueeze(1), torch.randn(24))
bl = Infinite(Noisy(), num_workers=NUM_WORKERS)
it = iter(DataLoader(ds, batch_size=5, shuffle=True))
for step in range(14):
    xb, yb = bl.next()
    extra = next(it, None)
    noise = torch.rand(1).item()
    print(step, xb.flatten().tolist(), yb.sum().item().hex(), None if extra is None else extra[0].flatten().tolist(), noise)
"""


def _chain(launcher: Launcher, src: str, tmp_path, seed: int) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(src))
    expected, trace = uninterrupted(launcher, src, [str(script)], tmp_path)
    stops = pick_stops(trace, seed, extra=2)
    out, _ = run_chain(launcher, [str(script)], stops, tmp_path / f"ck-{seed}")
    assert out == expected, f"seed {seed}, stops {stops}"


@pytest.mark.parametrize("seed", SEEDS)
def test_gradients_survive_a_restore(launcher, tmp_path, seed):
    _chain(launcher, GRAD_ACCUMULATION, tmp_path, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_lbfgs_with_a_closure_steps_after_a_restore(launcher, tmp_path, seed):
    _chain(launcher, LBFGS_CLOSURE, tmp_path, seed)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_iterators_held_in_objects_resume_at_the_same_batch(launcher, tmp_path, workers):
    src = ITERATOR_HOLDER.replace("NUM_WORKERS", str(workers))
    for seed in SEEDS[:2]:
        _chain(launcher, src, tmp_path / str(seed), seed)


ZIPPED_LOADERS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
a = DataLoader(TensorDataset(torch.arange(12.0)), batch_size=2, shuffle=True, num_workers=NUM_WORKERS)
b = DataLoader(TensorDataset(torch.arange(100.0, 112.0)), batch_size=2, shuffle=True)
for epoch in range(2):
    for (x,), (y,) in zip(a, b):
        print(epoch, x.tolist(), y.tolist(), torch.rand(1).item())
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_zipped_shuffled_loaders_resume_exactly(launcher, tmp_path, workers):
    """Each loader's sampler draws its shuffle seed at its own first batch, after both iter()s:
    rebuilding them one after the other used to give the first loader another order."""
    for seed in SEEDS[:2]:
        _chain(launcher, ZIPPED_LOADERS.replace("NUM_WORKERS", str(workers)), tmp_path / str(seed), seed)


def test_tensor_flags_views_and_subclasses_resume_exactly(tmp_path):
    """requires_grad, views of a parameter, a retained non-leaf grad and a tensor subclass."""
    src = """
import torch

class Tagged(torch.Tensor):
    pass

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(6, 4))
row = w[2]
frozen = torch.randn(4).requires_grad_(False)
tag = torch.randn(3).as_subclass(Tagged)
for step in range(4):
    h = (w * 2)
    h.retain_grad()
    loss = (h.sum(1) ** 2).mean() + frozen.sum()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
    print(step, loss.item().hex(), row.sum().item().hex(), h.grad.sum().item().hex(), w.requires_grad,
          frozen.requires_grad, type(tag).__name__, (row.data_ptr() - w.data_ptr()) // 4)
    w.grad = None
"""
    for seed in SEEDS:
        assert_exact_in_process(src, tmp_path / str(seed), seed, stops=4)
