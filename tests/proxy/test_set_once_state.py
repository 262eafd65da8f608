"""State a script sets up once, before its loop, that lives outside its variables or refers to
the process: hooks on parameters, ``atexit`` handlers, grad mode and the ``decimal`` context set
by plain calls, flushing denormals, modules with parametrizations, dicts and sets keyed by
``id(param)``, patched library functions and methods (``F.gelu = my_gelu``), and settings a
with statement switches around the safe point (``np.printoptions``, ``warnings.catch_warnings``). A restore does not run those statements
again, so each used to be lost (a gradient-clamping hook stopped, the run's summary was written
at the preemption and never again, tensors required grad again) or made the checkpoint fail
(``weight_norm``). Found by running realistic scripts at random stops."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from harness import pick_stops, run_chain, trace_of

HOOKS = """
import functools
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
calls = []

def clamp(g):
    return g.clamp(-0.01, 0.01)

def scale(g, s):
    return g * s

h = model.weight.register_hook(clamp)
model.bias.register_hook(lambda g: g * 0.5)
model.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
model.weight.register_hook(functools.partial(scale, s=0.9))   # no handle kept
opt = torch.optim.SGD(model.parameters(), lr=0.5)
x, y = torch.randn(32, 4), torch.randn(32, 2)
for step in range(10):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    if step == 6:
        h.remove()   # a handle saved by the checkpoint still removes its hook
        for s in (1.0, 0.5, 0.2):  # new ids must not replace the hook registered without a handle
            model.weight.register_hook(functools.partial(scale, s=s))
    print(step, round(loss.item(), 8), model.weight.sum().item(), len(calls))
"""

ATEXIT = """
import atexit
import json
import os

state = {"steps": 0, "total": 0}

def write_summary(path):
    with open(path, "w") as f:
        json.dump(state, f)
    print("summary written", state)

class Reporter:
    def close(self):
        print("reporter closed at", state["steps"])

atexit.register(write_summary, os.path.join(os.path.dirname(os.path.abspath(__file__)), "summary.json"))
atexit.register(Reporter().close)
dropped = lambda: print("never: unregistered")
atexit.register(dropped)
for step in range(12):
    state["total"] += step * step
    state["steps"] = step + 1
    if step == 5:
        atexit.unregister(dropped)
    print(step, state["total"])
"""

MODES = """
import decimal
import torch

torch.set_grad_enabled(False)       # an evaluation script's first line
torch.set_flush_denormal(True)
decimal.getcontext().prec = 6
w = torch.ones(3, requires_grad=True)
tiny = torch.tensor([1e-39, 1.0])
acc = decimal.Decimal(0)
for step in range(6):
    y = (w * 2).sum()
    acc += decimal.Decimal(1) / decimal.Decimal(7)
    with torch.enable_grad():
        for k in range(2):
            print(step, k, "grad", torch.is_grad_enabled())
    with decimal.localcontext() as ctx:
        ctx.prec = 3
        for k in range(2):
            print(step, k, decimal.Decimal(2) / decimal.Decimal(3))
    print(step, y.requires_grad, (tiny * 1.0)[0].item(), acc, torch.is_grad_enabled())
"""

PARAMETRIZED = """
import warnings
warnings.simplefilter("ignore")
import torch
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

torch.manual_seed(0)
model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 8)), torch.nn.Tanh(),
                            spectral_norm(torch.nn.Linear(8, 8)), orthogonal(torch.nn.Linear(8, 8)),
                            torch.nn.utils.weight_norm(torch.nn.Linear(8, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x, y = torch.randn(64, 4), torch.randn(64, 1)
for step in range(8):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    print(step, loss.item())
"""

ID_KEYS = """
import torch

class MyMomentum:
    def __init__(self, params, lr):
        self.params = list(params)
        self.lr = lr
        self.buffers = {id(p): torch.zeros_like(p) for p in self.params}
        self.frozen = set()

    def freeze(self, p):
        self.frozen.add(id(p))

    def step(self):
        with torch.no_grad():
            for p in self.params:
                if id(p) in self.frozen:
                    continue
                b = self.buffers[id(p)]
                b.mul_(0.9).add_(p.grad)
                p.sub_(self.lr * b)

def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = MyMomentum(model.parameters(), 0.05)
    opt.freeze(model[0].bias)
    names = {id(p): n for n, p in model.named_parameters()}
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    for step in range(8):
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        print(step, round(loss.item(), 7), names.get(id(model[2].weight)))

if __name__ == "__main__":
    main()
"""

PATCHES = """
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cudnn.deterministic = True   # a module that is an instance of a subclass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.gelu(self.fc(x))


def tanh_gelu(x, approximate="none"):
    return 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


def main():
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    F.gelu = tanh_gelu                                   # a patched library function
    nn.Linear.extra_repr = lambda self: "patched"        # a patched library method
    model = nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for step in range(6):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        print(step, loss.item(), repr(model[0].fc), torch.backends.cudnn.deterministic)


main()
"""

SWITCHED = """
import contextlib
import os
import warnings
import numpy as np
import torch

x = np.array([1 / 3, 2 / 3])
np.seterr(all="raise")
with np.printoptions(precision=3):
    for epoch in range(2):
        print("in block", x * epoch)
print("after block", x)
with np.errstate(divide="ignore"):
    for k in range(2):
        print(k, np.log(np.array([0.0, 1.0 + k])))
try:
    np.log(np.array([0.0]))
except FloatingPointError as e:
    print("after block: raised", e)
with warnings.catch_warnings():
    warnings.simplefilter("error")          # a plain call inside: not run again by a restore
    for k in range(2):
        print("strict", k, warnings.filters[0][0])
print("after block", warnings.filters[0][0] if warnings.filters else None)
with torch.autograd.detect_anomaly(check_nan=False):
    for k in range(2):
        print("debug", k, torch.is_anomaly_enabled())
print("after block: anomaly", torch.is_anomaly_enabled())
with torch.device("meta"):
    for k in range(2):
        print("in block", k, torch.zeros(2).device)
print("after block:", torch.zeros(2).device)
HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)
os.makedirs("run1", exist_ok=True)
with contextlib.chdir("run1"):                # entered again on restore: relative to the cwd outside
    for k in range(2):
        print("in", os.path.basename(os.getcwd()))
print("after block back:", os.getcwd() == HERE)
"""

SCRIPTS = {"hooks": HOOKS, "switched": SWITCHED, "patches": PATCHES, "atexit": ATEXIT, "modes": MODES, "parametrized": PARAMETRIZED, "id_keys": ID_KEYS}


def _plain(script, cwd) -> str:
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_state_set_before_the_loop_survives_restores(launcher, tmp_path, name):
    plain_dir, chain_dir = tmp_path / "plain", tmp_path / "chain"
    plain_dir.mkdir()
    chain_dir.mkdir()
    for folder in (plain_dir, chain_dir):
        (folder / "job.py").write_text(textwrap.dedent(SCRIPTS[name]))
    expected = _plain(plain_dir / "job.py", plain_dir)
    target = [str(chain_dir / "job.py")]
    base, trace = trace_of(launcher, target, chain_dir)
    assert base.stdout == expected
    stops = set(pick_stops(trace, 5, extra=2))
    if name == "modes":  # inside each with statement's loop: they are entered again on restore
        inner = [t["step"] for t in trace if t["kind"] == "loop" and len(t["loops"]) == 2]
        stops |= {inner[3], inner[6]}
    if name == "parametrized":  # the loop's first header: the old weight_norm's weight, computed when
        # it was registered, holds a graph nothing backpropagates; a checkpoint there waits for the
        # next safe point (autograd_graphs.py), which run_chain would take for a missed stop
        stops.discard(next(t["step"] for t in trace if t["kind"] == "loop"))
    if name == "switched":  # in the last iteration of each with statement's loop
        last_of_line = {t["line"]: t["step"] for t in trace if t["kind"] == "loop"}
        stops |= set(last_of_line.values())
    (chain_dir / "summary.json").unlink(missing_ok=True)
    out, _ = run_chain(launcher, target, sorted(stops), chain_dir / "ck")
    assert out == expected
    if name == "atexit":  # written once, by the run's real end, with the whole run's state
        assert json.loads((chain_dir / "summary.json").read_text()) == {"steps": 12, "total": 506}
