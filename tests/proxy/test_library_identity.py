"""What libraries compare by identity stays the library's object across restores, and typed
classes of the script restore more than once (found by running realistic scripts):

* ``argparse.SUPPRESS``: a parser restored before ``parse_args`` gained ``'help': '==SUPPRESS=='``
  in ``vars(args)`` (argparse tests ``action.default is not SUPPRESS``), which a sweep then passed
  on as ``SGD(..., help=...)``;
* ``dataclasses.MISSING``: ``f.default is MISSING`` was false for the fields of a dataclass the
  script defines, so "print the options that differ from their defaults" listed every one;
* a ``typing.NamedTuple`` or ``Generic[T]`` class of the script: the checkpoint of a restored
  process did not load (``'function' object has no attribute '__mro__'``)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import assert_chains_match, trace_of

TYPED_CONFIG = """
import argparse, dataclasses
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

@dataclasses.dataclass
class Config:
    lr: float = 0.1
    steps: int = 8
    tags: list = dataclasses.field(default_factory=list)

class Point(NamedTuple):
    step: int
    loss: float

class Box(Generic[T]):
    def __init__(self, item: T):
        self.item = item

def overridden(cfg):
    out = {}
    for f in dataclasses.fields(cfg):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if getattr(cfg, f.name) != default:
            out[f.name] = getattr(cfg, f.name)
    return out

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--steps", type=int, default=8)
history = []
for trial, lr in enumerate([0.1, 0.2, 0.3]):
    args = parser.parse_args(["--lr", str(lr)])
    cfg = Config(**vars(args))
    for step in range(cfg.steps):
        history.append(Box(Point(step, cfg.lr / (step + 1))))
    print(trial, sorted(vars(args)), overridden(cfg), round(sum(b.item.loss for b in history), 6), flush=True)
"""


def test_library_sentinels_and_typed_classes_survive_several_restores(launcher, tmp_path):
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent(TYPED_CONFIG))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.stdout == base.stdout and "['lr', 'steps'] {'lr': 0.2}" in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(1, 2), extra=4)
