"""Classes with an ``__init_subclass__`` hook restore without running it again: it ran when the
program defined each subclass, and what it did (a count, a registry) is in the checkpoint. A
restore that ran it again raised ``NameError`` on the base's own name (the namespace was still
loading), ``TypeError`` for a hook with a required keyword (``class Adder(Plugin, kind=...)``), or
counted every class twice."""
from __future__ import annotations

from harness import assert_chains_match, trace_of

HOOKS = """
COUNT = {"n": 0}

class Plugin:
    kinds = {}

    def __init_subclass__(cls, kind, **kw):
        super().__init_subclass__(**kw)
        if not issubclass(cls, Plugin):
            raise TypeError("not a Plugin")
        COUNT["n"] += 1
        cls.kind = kind

class Adder(Plugin, kind="add"):
    def f(self, x):
        return x + 1

def main():
    class Doubler(Plugin, kind="double"):  # a class defined in a function is saved by value too
        def f(self, x):
            return 2 * x

    total = 0
    for step in range(8):
        for c in (Adder, Doubler):
            total = c().f(total)
        print(step, total, COUNT, Adder.kind, Doubler.kind, flush=True)

main()
"""


def test_init_subclass_hooks_do_not_run_again_at_restore(launcher, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HOOKS)
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert base.rc == 0 and "7 510 {'n': 2} add double" in base.stdout, base.describe()
    assert_chains_match(launcher, [str(script)], base, trace, tmp_path, seeds=(2,), extra=2)
