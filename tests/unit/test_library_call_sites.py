"""Calls between library modules that are both rewritten are call sites (a restore re-enters them):
``call._call_and_handle_interrupt(...)`` in Lightning's trainer, after ``from
lightning.pytorch.trainer import call``, stood between ``trainer.fit`` and its loop."""
from __future__ import annotations

import ast

from backend.proxy.engine.analysis import names_of_modules
from backend.proxy.engine.rewrite import rewrite_library

SOURCE = """
from lightning.pytorch.trainer import call, setup
from . import fit_loop as loops
import lightning.pytorch.trainer.call as calls
import torch

class Trainer:
    def fit(self, model):
        call._call_and_handle_interrupt(self, self._fit_impl, model)

    def other(self):
        torch.manual_seed(0)
"""
MODULE = "lightning.pytorch.trainer.trainer"
REWRITTEN = frozenset({"lightning.pytorch.trainer.call", "lightning.pytorch.trainer.fit_loop", MODULE})


def test_names_bound_to_rewritten_modules_are_found():
    assert names_of_modules(ast.parse(SOURCE), MODULE, REWRITTEN) == {"call", "loops", "calls"}
    assert names_of_modules(ast.parse(SOURCE), MODULE, frozenset()) == set()


def test_a_call_through_such_a_name_is_a_call_site():
    with_others = rewrite_library(SOURCE, "trainer.py", 0, module=MODULE, rewritten=REWRITTEN)
    alone = rewrite_library(SOURCE, "trainer.py", 0)
    assert [d.name for d in with_others.defs.values()] == ["fit"]  # `other` calls only into torch
    assert not alone.defs  # without the others, `call` is a library like torch
