"""Capture and restore the global random number generators.

Exact resume needs every generator the program draws from: python ``random``, the numpy global
RandomState, torch's CPU generator and every initialised CUDA device.  Capturing numpy is the
slow part (~25 us), so callers that only need torch (a DataLoader's ``iter()``) ask for less.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

RngState = dict[str, Any]


def capture(full: bool = True) -> RngState:
    """Snapshot the global generators; ``full=False`` takes torch (CPU and CUDA) only."""
    state: RngState = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if full:
        state["python"] = random.getstate()
        state["numpy"] = np.random.get_state()
    return state


def apply(state: Optional[RngState]) -> None:
    """Set the generators captured in ``state``; parts it lacks are left alone."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        for index in range(n):
            torch.cuda.set_rng_state(cuda[index], index)
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


def equal(a: RngState, b: RngState) -> bool:
    """True when two snapshots describe the same generator positions (common parts only)."""
    if not torch.equal(a["torch"], b["torch"]):
        return False
    if "cuda" in a and "cuda" in b:
        if len(a["cuda"]) != len(b["cuda"]):
            return False
        if not all(torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"])):
            return False
    if "python" in a and "python" in b and a["python"] != b["python"]:
        return False
    if "numpy" in a and "numpy" in b:
        na, nb = a["numpy"], b["numpy"]
        if na[0] != nb[0] or na[2:] != nb[2:] or not np.array_equal(na[1], nb[1]):
            return False
    return True
