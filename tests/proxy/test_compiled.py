"""``torch.compile`` puts the graphs it compiles (fake tensors, which have no data) in the globals
of the compiled code, the script's namespace: every checkpoint of a script that compiled its
model or its loss was refused. Those names are left out, and a restore compiles again."""
from __future__ import annotations

from harness import assert_resumes_at_iterations

COMPILED = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
compiled = torch.compile(model, backend="eager")

@torch.compile(backend="aot_eager")
def mse(prediction, target):
    return ((prediction - target) ** 2).mean()

opt = torch.optim.Adam(model.parameters(), 1e-2)
x, y = torch.randn(32, 4), torch.randn(32, 1)
for step in range(5):
    loss = mse(compiled(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(step, loss.item().hex())
"""


def test_a_compiled_model_and_loss_resume_exactly(launcher, tmp_path):
    assert_resumes_at_iterations(launcher, COMPILED, tmp_path, [1, 3])
