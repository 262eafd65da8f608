"""A module beside train.py; it imports because the script's folder is first on sys.path."""
from torch import nn


def make_model(width):
    return nn.Sequential(nn.Linear(3, width), nn.SiLU(), nn.Linear(width, 1))


def batch(generator):
    import torch
    x = torch.randn(12, 3, generator=generator)
    return x, x[:, :1] * x[:, 1:2] - x[:, 2:]


def setup_for_distributed(is_master):
    """As DeiT's and DETR's utils do: only the main process prints (and here, with a prefix)."""
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop("force", False)
        if is_master or force:
            builtin_print("[main]", *args, **kwargs)

    __builtin__.print = print


class RunSummary:
    """Prints the run's summary when it is collected, at the interpreter's exit."""

    def __init__(self):
        self.losses = []

    def __del__(self):
        print(f"summary: {len(self.losses)} steps, last loss {self.losses[-1]!r}", flush=True)
