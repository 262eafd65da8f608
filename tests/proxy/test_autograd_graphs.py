"""A checkpoint saves tensors' values, not their autograd graphs: restored between a forward
pass and its ``backward()``, a loss (an L2 penalty added parameter by parameter, micro-batch
losses summed for gradient accumulation) reached no parameter, and that update was lost
silently. Such a safe point now takes no checkpoint: the request waits for the next one, after
``backward()``, and the run resumes exactly."""
from __future__ import annotations

import textwrap

from harness import EXIT_PREEMPTED, trace_of

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
