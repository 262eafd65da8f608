"""Instances of classes with a ``__getattr__`` load again: a wrapper handing unknown attributes to
the model it wraps recursed forever at restore, and ``tempfile.NamedTemporaryFile`` raised
``KeyError: 'file'`` (the checkpoint was written; the restore crashed)."""
from __future__ import annotations

import io
import pickle

from backend.proxy.engine import context
from backend.proxy.engine.state import ProxyPickler
from harness import assert_chains_match, trace_of

WRAPPED = """
import argparse, tempfile
import torch

class EMA:
    \"\"\"Averaged weights; everything else is the model's.\"\"\"
    def __init__(self, model, decay):
        self.model, self.decay = model, decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def __getattr__(self, name):
        return getattr(self.model, name)

    def update(self):
        with torch.no_grad():
            for s, p in zip(self.shadow, self.model.parameters()):
                s.mul_(self.decay).add_(p, alpha=1 - self.decay)

class Slotted:
    __slots__ = ("inner", "count")
    def __init__(self, inner):
        self.inner, self.count = inner, 0
    def __getattr__(self, name):
        return getattr(self.inner, name)

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    ema = EMA(torch.nn.Linear(4, 1), 0.9)
    opt = torch.optim.SGD(ema.parameters(), lr=0.1)
    seen = Slotted([])
    scratch = tempfile.NamedTemporaryFile("w+", suffix=".log")
    x = torch.randn(16, 4)
    for step in range(args.steps):
        loss = ema.forward(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()
        seen.append(step)
        seen.count += 1
        scratch.write(f"{step} {loss.item():.6f}\\n")
        scratch.flush()
        print(step, f"{loss.item():.8f}", f"{ema.shadow[0].sum().item():.8f}", seen.count, len(seen.inner),
              ema.weight.shape, flush=True)
    scratch.seek(0)
    print(len(scratch.read().splitlines()), "lines in", scratch.name.endswith(".log"))
    scratch.close()

main()
"""


def test_wrappers_with_getattr_and_a_named_temporary_file_resume_exactly(launcher, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WRAPPED)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.rc == 0 and "10 lines in True" in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(8,), extra=2)


class Delegating:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DropsCache(Delegating):
    def __getstate__(self):
        return {"inner": self.inner}


def test_the_state_is_set_as_the_unpickler_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    context.begin()
    buf = io.BytesIO()
    shared = [1, 2]
    cached = DropsCache(shared)
    cached.cache = "dropped"
    ProxyPickler(buf, protocol=4).dump((Delegating(shared), cached, shared))
    plain, again, items = pickle.loads(buf.getvalue())
    assert plain.inner is items and again.inner is items and plain.count(2) == 1
    assert not hasattr(again, "cache") and again.__dict__ == {"inner": [1, 2]}
