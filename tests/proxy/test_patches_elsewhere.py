"""Monkeypatches made where research code makes them, through a chain of stops: DeiT's and DETR's
``utils.setup_for_distributed`` replaces ``builtins.print`` from a function of a helper module
(``import builtins as __builtin__`` inside it), a helper patches ``F.relu`` with ``setattr``,
another swaps ``F.gelu`` through
``importlib.import_module`` and ``F.silu``/``F.mish`` in a loop over their names, and the script
wraps ``builtins.print`` itself. Each was lost at a restore (output without the
prefix, the unpatched activation), and the wrapper could not be saved at all: its closure keeps
the original ``print``, which pickle looks for in ``builtins`` and finds replaced."""
from __future__ import annotations

import textwrap

from harness import pick_stops, run_chain, trace_of

UTILS = """
def setup_for_distributed(is_master):
    \"\"\"This function disables printing when not in master process\"\"\"
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop("force", False)
        if is_master or force:
            builtin_print("[main]", *args, **kwargs)

    __builtin__.print = print


def soften_relu(factor):
    import torch.nn.functional as F
    original = F.relu

    def relu(x, inplace=False):
        return original(x, inplace=inplace) * factor

    setattr(F, "relu", relu)


def fast_activations():
    import importlib
    functional = importlib.import_module("torch.nn.functional")
    exact_gelu = functional.gelu
    functional.gelu = lambda x, approximate="none": exact_gelu(x, approximate="tanh")
    for name in ("silu", "mish"):
        setattr(functional, name, _halved(getattr(functional, name)))


def _halved(fn):
    def halved(x, inplace=False):
        return fn(x) * 0.5
    return halved
"""

TRAIN = """
import builtins
import torch
import torch.nn.functional as F
import utils

stamp = builtins.print

def stamped(*args, **kwargs):
    stamp(*args, "|", **kwargs)

builtins.print = stamped

def main():
    utils.setup_for_distributed(True)
    utils.soften_relu(0.5)
    utils.fast_activations()
    torch.manual_seed(0)
    w = torch.randn(3, 3)
    x = torch.randn(4, 3)
    for step in range(8):
        x = F.relu(x @ w) + 0.25 * torch.tanh(x) + 0.1 * (F.gelu(x) + F.silu(x) + F.mish(x))
        print(step, f"{x.sum().item():.6f}", flush=True)

main()
"""


def test_patches_from_helper_modules_and_a_print_wrapper_survive_restores(launcher, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "utils.py").write_text(textwrap.dedent(UTILS))
    (job / "train.py").write_text(textwrap.dedent(TRAIN))
    target = [str(job / "train.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout.startswith("[main] 0 ") and base.stdout.count("|\n") == 8, base.describe()
    for seed in (1, 2):
        stops = pick_stops(trace, seed, extra=2)
        out, runs = run_chain(launcher, target, stops, tmp_path / f"ck{seed}")
        assert out == base.stdout, f"stops {stops}\n{runs[-1].describe()}"
        assert not any("cannot be saved" in r.stderr for r in runs), runs[0].stderr
