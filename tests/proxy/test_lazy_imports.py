"""A job that never imports torch or numpy must not pay for them (backend/proxy/engine/lazy.py).

Runs that must not see torch use fresh interpreters: the warm fork server has torch loaded.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import EXIT_PREEMPTED, PYTHON, Launcher, run_chain, trace_of

from backend.proxy.engine import lazy

TORCH_FREE = '''
import random
import sys

random.seed(7)
total = 0.0
for i in range(6):
    total += random.random()
    print("a", i, round(total, 12))
words = []
for w in "one two three four".split():
    words.append(w.upper())
    print("b", words, random.randint(0, 99))
print("loaded", "torch" in sys.modules, "numpy" in sys.modules)
'''

NUMPY_ONLY = '''
import sys

import numpy as np

np.random.seed(3)
acc = np.zeros(2)
for i in range(5):
    acc = acc + np.random.rand(2)
    print(i, acc.round(12).tolist())
print("torch loaded", "torch" in sys.modules)
'''


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code], cwd="/tmp", capture_output=True, text=True, timeout=60,
                          env=Launcher._env({}))


def test_importing_the_engine_loads_neither_torch_nor_numpy():
    proc = _python(textwrap.dedent("""
        import sys, backend.proxy
        from backend.proxy.engine import rng
        assert set(rng.capture()) == {"python"}, rng.capture()
        assert "torch" not in sys.modules and "numpy" not in sys.modules, "a heavy import leaked"
        print("ok")
    """))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_torch_free_script_stops_and_resumes_without_importing_torch(fresh_launcher, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(TORCH_FREE)
    target = [str(script)]
    base, trace = trace_of(fresh_launcher, target, tmp_path)
    assert base.stdout.splitlines()[-1] == "loaded False False"
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    stops = [loops[2], loops[-2]]

    args = target + ["--checkpoint-dir", str(tmp_path / "ck")]
    runs = [fresh_launcher.run(args + ["--stop-at-step", str(stops[0])])]
    assert runs[0].rc == EXIT_PREEMPTED, runs[0].describe()
    (rank_file,) = (tmp_path / "ck").glob("ckpt-*/rank-0.pt")
    assert rank_file.read_bytes()[:1] == b"\x80", "without torch the graph is a plain pickle"
    runs.append(fresh_launcher.run(args + ["--restore", "--stop-at-step", str(stops[1])]))
    runs.append(fresh_launcher.run(args + ["--restore"]))
    assert [r.rc for r in runs] == [EXIT_PREEMPTED, EXIT_PREEMPTED, 0], runs[-1].describe()
    for run, stop in zip(runs[1:], stops):
        assert [d["step"] for _, d in run.events("restore")] == [stop], run.describe()
    assert "".join(r.stdout for r in runs).splitlines() == base.stdout.splitlines()
    assert runs[-1].stdout.splitlines()[-1] == "loaded False False", "a restore imported torch or numpy"


def test_numpy_only_script_resumes_exactly_without_torch(fresh_launcher, tmp_path):
    script = tmp_path / "np_only.py"
    script.write_text(NUMPY_ONLY)
    target = [str(script)]
    base, trace = trace_of(fresh_launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(fresh_launcher, target, [loops[1], loops[3]], tmp_path / "ck")
    assert out.splitlines() == base.stdout.splitlines()
    assert out.splitlines()[-1] == "torch loaded False"


def test_checkpoints_with_and_without_torch_restore_into_each_other(launcher, fresh_launcher, tmp_path):
    """Plain pickle -> restored where torch is loaded (tensors possible) -> restored by a fresh run."""
    script = tmp_path / "plain.py"
    script.write_text(TORCH_FREE)
    target = [str(script)]
    base, trace = trace_of(fresh_launcher, target, tmp_path)
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    ck = tmp_path / "ck"
    args = target + ["--checkpoint-dir", str(ck)]
    runs = [fresh_launcher.run(args + ["--stop-at-step", str(loops[1])])]
    runs.append(launcher.run(args + ["--restore", "--stop-at-step", str(loops[-3])]))
    assert [r.rc for r in runs] == [EXIT_PREEMPTED] * 2, runs[-1].describe()
    (rank_file,) = ck.glob(f"ckpt-{loops[-3]:08d}/rank-0.pt")
    assert rank_file.read_bytes()[:2] == b"\x80\x05", "with torch loaded, dedup.dump writes it (protocol 5)"
    runs.append(fresh_launcher.run(args + ["--restore"]))
    assert runs[-1].rc == 0, runs[-1].describe()
    assert "".join(r.stdout for r in runs).splitlines()[:-1] == base.stdout.splitlines()[:-1]


def test_cli_fixes_torch_threads_when_the_script_imports_torch(fresh_launcher, tmp_path):
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads(), torch.get_num_interop_threads())\n")
    run = fresh_launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "ck"), "--threads", "1"])
    assert run.rc == 0, run.describe()
    assert run.stdout.split() == ["1", "1"]


def test_when_imported_runs_after_the_module_and_leaves_its_loader_alone(tmp_path, monkeypatch):
    (tmp_path / "sg_lazy_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    lazy.when_imported("sg_lazy_probe", lambda m: seen.append(m.VALUE + 1))
    assert not seen
    try:
        import sg_lazy_probe
    finally:
        sys.modules.pop("sg_lazy_probe", None)
    assert seen == [42]
    assert type(sg_lazy_probe.__loader__).__name__ == "SourceFileLoader"
    assert sg_lazy_probe.__spec__.loader is sg_lazy_probe.__loader__
    # its watch is consumed; the finder stays only while other modules are watched (the proxy
    # watches some itself, e.g. accelerate's data loader, once a program has run in this process)
    assert "sg_lazy_probe" not in lazy._after_import.pending
    assert (lazy._after_import in sys.meta_path) == bool(lazy._after_import.pending)
    lazy.when_imported("sys", lambda m: seen.append(m.__name__))  # already imported: called now
    assert seen == [42, "sys"]


def test_type_helpers_answer_for_torch_objects():
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(4)), shuffle=True)
    assert lazy.is_dataloader(loader) and not lazy.is_dataloader([1])
    assert lazy.is_builtin_sampler(loader.sampler) and lazy.is_builtin_sampler(loader.batch_sampler)
    assert lazy.is_array(torch.zeros(2)) and lazy.is_array(np.zeros(2)) and not lazy.is_array([1])
    assert lazy.is_storage(torch.zeros(2).untyped_storage()) and not lazy.is_storage(b"x")
    assert lazy.is_rng_free_generator(torch.nn.Linear(1, 1).parameters())
    assert lazy.is_torch_generator(torch.Generator()) and not lazy.is_torch_generator(None)

