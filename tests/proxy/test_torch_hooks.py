"""torch's global module hooks live in torch's own module, not in the program's variables: a restore
started without them (a profiler's counts stopped, silently), and the next checkpoint wrote their
handle so that it could not be loaded; so did a handle whose module was gone."""
from __future__ import annotations

import textwrap

from harness import run_chain, trace_of

GLOBAL_HOOKS = """
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

calls = {}
def count(module, args, output):                 # counts every layer's calls, as a profiler does
    calls[type(module).__name__] = calls.get(type(module).__name__, 0) + 1

handle = register_module_forward_hook(count)
register_module_forward_pre_hook(lambda module, args: None)   # its handle dropped at once
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
probe = torch.nn.Linear(2, 2)
probe_handle = probe.register_forward_hook(lambda m, i, o: None)
probe = None                                     # the module goes: its handle's dicts are freed
for step in range(6):
    model(torch.randn(2, 3)).sum().backward()
    if step == 3:
        handle.remove()
    print(step, sorted(calls.items()))
"""


def test_global_module_hooks_and_handles_of_gone_modules_survive_a_chain_of_stops(launcher, tmp_path):
    script = tmp_path / "hooks.py"
    script.write_text(textwrap.dedent(GLOBAL_HOOKS))
    base, trace = trace_of(launcher, [str(script)], tmp_path)
    assert "3 [('Linear', 8), ('ReLU', 4), ('Sequential', 4)]" in base.stdout
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(script)], [loops[1], loops[2], loops[4]], tmp_path / "ck")
    assert out == base.stdout, runs[-1].describe()
