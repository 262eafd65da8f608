"""A checkpoint saves tensors' values, not their autograd graphs: restored between a forward
pass and its ``backward()``, a loss (an L2 penalty added parameter by parameter, micro-batch
losses summed for gradient accumulation) reached no parameter, and that update was lost
silently. Such a safe point now takes no checkpoint: the request waits for the next one, after
``backward()``, and the run resumes exactly."""
from __future__ import annotations

import textwrap

from harness import EXIT_PREEMPTED, assert_resumes_at_iterations, loop_steps, run_chain, trace_of

PENALTY_AND_ACCUMULATION = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(32, 4); Y = X.sum(1, keepdim=True)
for step in range(4):
    loss = nn.functional.mse_loss(model(X), Y)
    for p in model.parameters():                 # L2 penalty, parameter by parameter
        loss = loss + 1e-3 * p.pow(2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    print("penalty", step, f"{loss.item():.6f}")
total = 0.0
for i in range(8):                               # gradient accumulation over summed losses
    total = total + nn.functional.mse_loss(model(X[i * 4:(i + 1) * 4]), Y[i * 4:(i + 1) * 4]) / 2
    if i % 2 == 1:
        opt.zero_grad(); total.backward(); opt.step()
        print("accumulated", i, f"{total.item():.6f}")
        total = 0.0
"""


def test_a_safe_point_between_forward_and_backward_defers_the_checkpoint_and_the_run_resumes_exactly(launcher, tmp_path):
    script = tmp_path / "graphs.py"
    script.write_text(textwrap.dedent(PENALTY_AND_ACCUMULATION))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    lines = PENALTY_AND_ACCUMULATION.splitlines()
    inner = next(i for i, x in enumerate(lines, 1) if "for p in model.parameters()" in x)
    accumulating = next(i for i, x in enumerate(lines, 1) if x.startswith("for i in range(8)"))
    # the penalty loop's iterations after its first hold `loss` with its graph; so do the
    # accumulation loop's odd iterations (`total` of the micro-batch before)
    requested = [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == inner][2::5] + \
                [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == accumulating][1::4]
    deferred = 0
    for step in requested:
        ck = tmp_path / f"ck-{step}"
        stopped = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(step)])
        assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
        [at] = [d["step"] for _, d in stopped.events("stopped")]
        deferred += at > step
        assert not stopped.events("checkpoint_failed"), stopped.describe()
        resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
        assert resumed.rc == 0 and stopped.stdout + resumed.stdout == base.stdout, (step, at, resumed.describe())
    assert len(requested) >= 3 and deferred == len(requested), (deferred, requested)


VALIDATION_WITHOUT_NO_GRAD = """
import os
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(240, 4), torch.randn(240, 1)
xv, yv = torch.randn(16, 4), torch.randn(16, 1)
for epoch in range(3):
    for i in range(0, 240, 4):
        opt.zero_grad()
        loss = ((model(x[i:i + 4]) - y[i:i + 4]) ** 2).mean()
        loss.backward()
        opt.step()
        if epoch == 1 and i == 236 and os.environ.get("BACKPROP_IT"):
            val_loss.backward()                 # the last epoch's, late in this one
    val_loss = ((model(xv) - yv) ** 2).mean()   # no torch.no_grad(): it holds a graph all epoch
    print(epoch, round(loss.item(), 6), round(val_loss.item(), 6))
"""


def test_a_graph_nothing_backpropagates_is_cut_after_a_while_and_backprop_through_it_refuses(launcher, tmp_path):
    """A validation loss computed without no_grad held checkpoints off for good (a stop request was
    dropped); after waiting its patience the checkpoint cuts the graph: the run resumes exactly,
    and backward() through the cut tensor fails naming it instead of updating nothing."""
    script = tmp_path / "val.py"
    script.write_text(textwrap.dedent(VALIDATION_WITHOUT_NO_GRAD))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    second_epoch = [t["step"] for t in trace if t["kind"] == "loop" and len(t["loops"]) == 2 and t["loops"][0] == 2]
    ck = tmp_path / "ck"
    stopped = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(second_epoch[0])])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    [started] = [d for _, d in stopped.events("checkpoint_started")]
    assert started["cut_graphs"] == ["`val_loss`"] and started["step"] > second_epoch[0], started
    resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore", "--keep-checkpoints"])
    assert resumed.rc == 0 and stopped.stdout + resumed.stdout == base.stdout, resumed.describe()
    failed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"], {"BACKPROP_IT": "1"})
    assert failed.rc != 0 and "the autograd graph of `val_loss` was cut by a checkpoint" in failed.stderr, \
        failed.describe()


LONG_ACCUMULATION = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(32, 4); Y = X.sum(1, keepdim=True)
losses = []
total = 0.0
for i in range(240):                             # 80 micro-batch losses summed, then one backward()
    total = total + nn.functional.mse_loss(model(X[i % 32:i % 32 + 1]), Y[i % 32:i % 32 + 1]) / 80
    losses.append(total)                         # a list that grows with the graph
    if i % 80 == 79:
        opt.zero_grad(); total.backward(); opt.step()
        print(i, f"{total.item():.6f}")
        total = 0.0
        losses = []
"""


def test_an_accumulation_longer_than_the_patience_is_waited_for_not_cut(launcher, tmp_path):
    """Summing more micro-batch losses than the safe points' patience before one backward():
    the graph grows at every safe point, so the request waits for the backward instead of
    cutting the sum (whose backward() would then have failed after a restore)."""
    script = tmp_path / "accumulate.py"
    script.write_text(textwrap.dedent(LONG_ACCUMULATION))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    loop = [t["step"] for t in trace if t["kind"] == "loop" and len(t["loops"]) == 1]
    for step in (loop[85], loop[5]):  # early in the second group, and in the first
        ck = tmp_path / f"ck-{step}"
        stopped = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(step)])
        assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
        [started] = [d for _, d in stopped.events("checkpoint_started")]
        assert "cut_graphs" not in started and started["step"] > step + 50, started
        resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
        assert resumed.rc == 0 and stopped.stdout + resumed.stdout == base.stdout, resumed.describe()


HELD_DEEPER = """
import torch, torch.nn as nn

class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.saved_log_probs = []                # REINFORCE keeps an episode's log-probs here

    def forward(self, x):
        return torch.log_softmax(self.fc(x), dim=-1)

class Trainer:
    def __init__(self, model):
        self.model, self.accum_loss = model, 0.0
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def micro_step(self, i):                     # gradient accumulation on an attribute
        self.accum_loss = self.accum_loss + self.model(torch.ones(1, 4) * i)[0, 0] / 4
        if i % 4 == 3:
            self.opt.zero_grad(); (-self.accum_loss).backward(); self.opt.step()
            print("accumulated", i, f"{self.accum_loss.item():.6f}")
            self.accum_loss = 0.0

torch.manual_seed(0)
policy = Policy()
opt = torch.optim.SGD(policy.parameters(), lr=0.05)
for episode in range(3):
    saved = []                                   # and (log_prob, reward) tuples in a local list
    for t in range(6):
        log_probs = policy(torch.randn(1, 4))
        action = torch.multinomial(log_probs.exp(), 1).item()
        policy.saved_log_probs.append(log_probs[0, action])
        saved.append((log_probs[0, 1 - action], float(t)))
    loss = -torch.stack(policy.saved_log_probs).sum() + sum(lp * r for lp, r in saved)
    opt.zero_grad(); loss.backward(); opt.step()
    del policy.saved_log_probs[:]
    print("episode", episode, f"{loss.item():.6f}", policy.fc.weight.flatten().tolist())
trainer = Trainer(policy)
for i in range(12):
    trainer.micro_step(i)
"""


def test_a_graph_held_in_an_attribute_or_a_nested_list_defers_the_checkpoint_too(launcher, tmp_path):
    """Graphs the variables hold only through an object's attribute or a list of tuples: the save
    meets them and stops, the request waits for the backward(), and the run resumes exactly.
    Before, the checkpoint was taken at once and the restored run lost those steps' updates."""
    script = tmp_path / "deep.py"
    script.write_text(textwrap.dedent(HELD_DEEPER))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    lines = HELD_DEEPER.splitlines()
    episode_steps = next(i for i, x in enumerate(lines, 1) if x.startswith("    for t in range(6)"))
    micro_steps = next(i for i, x in enumerate(lines, 1) if x.startswith("for i in range(12)"))
    requested = [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == episode_steps][3::7] + \
                [t["step"] for t in trace if t["kind"] == "loop" and t["line"] == micro_steps][1:2]
    for step in requested:
        ck = tmp_path / f"ck-{step}"
        stopped = launcher.run(target + ["--checkpoint-dir", str(ck), "--stop-at-step", str(step)])
        assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
        [at] = [d["step"] for _, d in stopped.events("stopped")]
        assert at > step and not stopped.events("checkpoint_failed"), stopped.describe()
        resumed = launcher.run(target + ["--checkpoint-dir", str(ck), "--restore"])
        assert resumed.rc == 0 and stopped.stdout + resumed.stdout == base.stdout, (step, at, resumed.describe())


TIED_VIEW = """
import torch, torch.nn as nn
torch.manual_seed(0)
enc = nn.Linear(8, 3, bias=False)
Wt = enc.weight.t()                              # a tied decoder: a view of the parameter, made once
wq, wk = enc.weight[:1], enc.weight[1:]          # slices of it, as attention modules keep them
opt = torch.optim.SGD(enc.parameters(), lr=0.1)
for step in range(8):
    x = torch.randn(16, 8)
    recon = nn.functional.linear(torch.tanh(enc(x)), Wt)
    loss = ((recon - x) ** 2).mean() + (wq @ wk.t()).pow(2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    print(step, loss.item().hex())
"""


def test_a_view_of_a_parameter_made_once_keeps_its_graph_to_the_parameter(launcher, tmp_path):
    """``Wt = enc.weight.t()`` before the loop: its graph holds no saved tensor, so it was saved
    as values and came back as a view without a graph, through which no gradient reached the
    parameter: every step after a restore differed, silently."""
    assert_resumes_at_iterations(launcher, TIED_VIEW, tmp_path, [2, 5])


SAVED_THROUGH_HOOKS = """
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint

class Scale(torch.autograd.Function):            # a custom Function: its saved tensors are its own
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)

torch.manual_seed(0)
block = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
gain = nn.Parameter(torch.ones(8))
head = nn.Linear(8, 1)
opt = torch.optim.SGD([*block.parameters(), gain, *head.parameters()], lr=0.1)
X = torch.randn(64, 4); Y = X.sum(1, keepdim=True)
for step in range(4):
    total = 0.0
    for i in range(4):                           # accumulation through an activation-checkpointed block
        h = checkpoint(block, X[i * 16:(i + 1) * 16], use_reentrant=False)
        total = total + nn.functional.mse_loss(head(Scale.apply(h, gain)), Y[i * 16:(i + 1) * 16]) / 4
    opt.zero_grad(); total.backward(); opt.step()
    print(step, total.item().hex(), block[1].num_batches_tracked.item(), block[1].running_mean.sum().item().hex())
"""


def test_saved_tensors_behind_hooks_or_a_custom_function_are_looked_at_without_unpacking(launcher, tmp_path):
    """While a checkpoint waits for ``total``'s backward(), the check reads the graph's saved tensors.
    Unpacked, a ``checkpoint(..., use_reentrant=False)`` block computed its forward again to give
    them back, and its BatchNorm counted one batch more each time (silently); a graph of a custom
    autograd Function alone was not seen as held at all. The raw saved variables say both."""
    script = tmp_path / "hooks.py"
    script.write_text(textwrap.dedent(SAVED_THROUGH_HOOKS))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    micro = loop_steps(trace, SAVED_THROUGH_HOOKS, "    for i in range(4)")
    stops = [micro[2], micro[9]]                   # both hold `total` with its graph: deferred
    out, runs = run_chain(launcher, target, stops, tmp_path / "ck", deferred=True)
    assert out == base.stdout, runs[-1].describe()


WITHOUT_SAVED_TENSORS = """
import torch

class Scale(torch.autograd.Function):            # keeps its input as a ctx attribute, saves no tensor
    @staticmethod
    def forward(ctx, x, w):
        ctx.x = x
        return x * w.detach().sum()

    @staticmethod
    def backward(ctx, grad):
        return None, (grad * ctx.x).sum().expand(4)

torch.manual_seed(0)
x, w = torch.randn(4), torch.randn(4, requires_grad=True)
b = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w, b], lr=0.1)
for step in range(4):
    loss = Scale.apply(x, w).sum() + b.sum()     # a graph in which no node saved a tensor
    for k in range(2):
        print("pending", step, k)
    opt.zero_grad(); loss.backward(); opt.step()
    print(step, w.sum().item().hex(), b.sum().item().hex(), loss)
"""


def test_a_graph_that_saves_no_tensor_is_waited_for_until_a_backward_runs_through_it(launcher, tmp_path):
    """No node of ``loss``'s graph saved a tensor, so no ``backward()`` frees anything there and it
    looked used: the checkpoint was taken between its forward and its ``backward()``, and after a
    restore that step's update was lost (silently). The save now waits until a ``backward()`` has
    run through it, then saves it cut, under its node's name (``print(loss)`` is unchanged)."""
    script = tmp_path / "unsaved.py"
    script.write_text(textwrap.dedent(WITHOUT_SAVED_TENSORS))
    target = [str(script)]
    base, trace = trace_of(launcher, target, tmp_path)
    assert "grad_fn=<AddBackward0>" in base.stdout
    inner = loop_steps(trace, WITHOUT_SAVED_TENSORS, "    for k in range(2)")
    out, runs = run_chain(launcher, target, [inner[1], inner[4]], tmp_path / "ck", deferred=True)
    assert out == base.stdout, runs[-1].describe()


MADE_ONCE = """
import torch
torch.manual_seed(0)
w1, w2 = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
W = torch.cat([w1, w2])                          # made once, backpropagated at every step
for step in range(6):
    loss = (W * torch.arange(6.0)).sum()
    loss.backward()
    print(step, w1.grad.tolist())
"""


def test_a_graph_that_saves_no_tensor_made_once_and_backpropagated_again_fails_loudly_after_a_restore(
        launcher, tmp_path):
    script = tmp_path / "once.py"
    script.write_text(textwrap.dedent(MADE_ONCE))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    ck = tmp_path / "ck"
    stopped = launcher.run([str(script), "--checkpoint-dir", str(ck), "--stop-at-step", str(loops[2])])
    assert stopped.rc == EXIT_PREEMPTED, stopped.describe()
    resumed = launcher.run([str(script), "--checkpoint-dir", str(ck), "--restore"])
    assert resumed.rc == 1 and "made by CatBackward0" in resumed.stderr, resumed.describe()
    assert "must be made again inside the loop" in resumed.stderr


KEPT_LOSSES = """
import torch
torch.manual_seed(0)
w = torch.randn(3, requires_grad=True)
history = []
for step in range(5):
    loss = (w * torch.randn(3)).pow(2).sum()
    loss.backward()
    history.append(loss)                         # kept with its graph, used already
    print(step, history[0], history[-1].is_leaf)
"""


def test_a_kept_loss_whose_graph_was_used_prints_as_before_after_a_restore(launcher, tmp_path):
    """Saved as values, a loss kept after its ``backward()`` came back a leaf: ``print(loss)``
    showed ``requires_grad=True`` where a plain run shows ``grad_fn=<SumBackward0>`` (silently)."""
    script = tmp_path / "kept.py"
    script.write_text(textwrap.dedent(KEPT_LOSSES))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert "grad_fn=<SumBackward0>) False" in base.stdout
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(script)], [loops[2], loops[3]], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()
