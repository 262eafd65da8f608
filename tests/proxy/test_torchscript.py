"""TorchScript in a script: a ``@torch.jit.script`` function (compiled code, no state, does not
pickle) is compiled again on restore by re-running its ``def``; a scripted model (it holds the
parameters) is refused, naming the variable and why: saved with ``torch.jit.save`` and loaded
again, its profiling executor optimized the graph at another call than in the uninterrupted run,
and the losses after a restore differed in the last bit (tried, so refused). Both were refused as "ScriptFunction cannot be
pickled" with no variable named: pickle's base ``PickleError`` was not taken for a pickling error."""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

SCRIPTED_FUNCTION = """
import torch

@torch.jit.script
def elu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.where(x > 0, x, alpha * (torch.exp(x) - 1))

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 4)
for step in range(8):
    opt.zero_grad()
    loss = elu(model(x), 0.5).pow(2).mean()
    loss.backward()
    opt.step()
    print(step, loss.item().hex())
"""

SCRIPTED_MODEL = """
import torch

torch.manual_seed(0)
model = torch.jit.script(torch.nn.Linear(4, 1))
for step in range(6):
    print(step, model(torch.ones(1, 4)).item().hex())
"""


def test_a_scripted_function_is_compiled_again_on_restore(launcher, tmp_path):
    (tmp_path / "fn.py").write_text(textwrap.dedent(SCRIPTED_FUNCTION))
    target = [str(tmp_path / "fn.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    out, runs = run_chain(launcher, target, pick_stops(trace, 1, extra=2), tmp_path / "ck")
    assert out == base.stdout
    assert any(d.get("rebuilt") == ["elu"] for r in runs for _, d in r.events("checkpointed"))


def test_a_scripted_model_is_refused_naming_it(launcher, tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(SCRIPTED_MODEL))
    run = launcher.run([str(tmp_path / "model.py"), "--checkpoint-dir", str(tmp_path / "ck"), "--stop-at-step", "3"])
    failed = [d for _, d in run.events("checkpoint_failed")]
    assert run.rc == 0 and failed, run.describe()
    assert failed[0]["variables"] and failed[0]["variables"][0][0] == "model", failed[0]
    assert "TorchScript module" in failed[0]["error"] and "trace or script it after the loop" in failed[0]["error"]
