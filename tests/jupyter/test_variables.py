"""Which notebook variables a cell reads (sent with the job) and sets (brought back)."""
from __future__ import annotations

import pytest

from jupyter_ext.variables import analyze, outputs_for, returnable, select_inputs


@pytest.mark.parametrize("source, reads, writes", [
    ("x = y + 1\nprint(x)", {"y", "print"}, {"x"}),
    ("total = total + 1", {"total"}, {"total"}),
    ("for i in range(n):\n    acc += i\nacc", {"range", "n", "acc"}, {"i", "acc"}),
    ("def f(a):\n    return a * scale + g(a)\nr = f(3)", {"scale", "g"}, {"f", "r"}),
    ("import torch\nfrom torch import nn as N\nm = N.Linear(d, 1)", {"d"}, {"torch", "N", "m"}),
    ("[v * k for v in vals if v > lim]", {"vals", "lim", "k"}, set()),
    ("if c:\n    z = 1\nprint(z)", {"c", "print", "z"}, {"z"}),          # z may come from the notebook
    ("if c:\n    z = 1\nelse:\n    z = 2\nprint(z)", {"c", "print"}, {"z"}),
    ("try:\n    w = load()\nexcept E as e:\n    w = e\nw", {"load", "E"}, {"w", "e"}),
    ("class A(Base):\n    k = K\n    def m(self):\n        return self.k + G\nobj = A()", {"Base", "K", "G"}, {"A", "obj"}),
    ("with open(p) as fh:\n    data = fh.read()", {"open", "p"}, {"fh", "data"}),
    ("(y := q + 1)\nlam = lambda t, s=S: t + s + Z", {"q", "S", "Z"}, {"y", "lam"}),
    ("def g():\n    global best\n    best = 3\ng()", set(), {"best", "g"}),
    ("model.weight = w\nlosses.append(1)\narr[i] = 2", {"w", "model", "losses", "arr", "i"}, set()),
    ("while cond:\n    cond = step(cond)", {"cond", "step"}, {"cond"}),
    ("match cmd:\n    case [a, *rest]:\n        out = a\n    case {'k': v, **kw}:\n        out = v", {"cmd"},
     {"a", "rest", "out", "v", "kw"}),
])
def test_reads_and_writes(source, reads, writes):
    names = analyze(source)
    assert set(names.reads) == reads
    assert set(names.writes) == writes


def test_reads_keep_first_use_order():
    assert analyze("c = b + a\nd = a + e").reads == ("b", "a", "e")


def test_syntax_error_is_raised():
    with pytest.raises(SyntaxError):
        analyze("!ls\nx = 1")


def test_select_inputs_skips_missing_hidden_and_ipython_history():
    ns = {"x": 1, "model": object(), "_": 5, "_i3": "code", "Out": {}, "secret": 2, "print": print}
    got = select_inputs(["x", "model", "missing", "_", "_i3", "Out", "secret", "print", "len"], ns, hidden={"secret"})
    assert set(got) == {"x", "model", "print"}  # a notebook name shadowing a builtin is sent


def test_mutated_names():
    names = analyze("losses.append(lr)\nopt.step()\nout = model(x[idx])\nn = len(data)\n"
                    "train(net, epochs=k)\ncfg.lr = 1\nbuf[0] = 2\ndel cache[k]\nprint(msg)\n"
                    "params.fc.weight.data.zero_()")
    assert names.mutated == {"losses", "lr", "opt", "model", "train", "net", "k", "cfg", "buf", "cache", "params"}


def test_outputs_include_changed_inputs_but_not_code_read_only_data_or_plain_values():
    import math

    names = analyze("losses.append(lr)\nmodel.step()\nf(math.pi)\nresult = len(data) + w[0]")
    inputs = {"losses": [], "lr": 0.1, "model": object(), "f": lambda v: v, "math": math, "data": [1], "w": [2]}
    assert returnable([]) and not returnable(0.1) and not returnable(math) and not returnable(len)
    assert outputs_for(names, inputs) == ["result", "losses", "model"]
    assert outputs_for(names, inputs, too_big=["losses"]) == ["result", "model"]
