"""Globals of the job's own modules and its sys.path entries travel with a checkpoint."""
from __future__ import annotations

import io
import os
import pickle
import sys
import threading

import pytest

from backend.proxy.engine import context, module_state
from backend.proxy.engine.state import ProxyPickler, probe


@pytest.fixture()
def job_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "src"), *sys.path])
    (tmp_path / "src").mkdir()
    (tmp_path / "jobconfig.py").write_text("lr = 0.5\nseen = []\n")
    (tmp_path / "src" / "jobhelpers.py").write_text(
        "import threading\nimport jobconfig\nlock = threading.Lock()\ncalls = 0\n"
        "def bump():\n    global calls\n    calls += 1\n    return calls\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    context.begin()
    module_state.begin()
    yield tmp_path
    for name in ("jobconfig", "jobhelpers"):
        sys.modules.pop(name, None)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    ProxyPickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


def test_module_globals_come_back_after_a_fresh_import(job_folder):
    import jobconfig
    import jobhelpers

    jobconfig.lr = 0.01
    jobconfig.seen.append("batch 0")
    jobhelpers.bump(), jobhelpers.bump()
    shared = jobconfig.seen
    saved = dumps({"modules": module_state.capture([str(job_folder)], probe), "namespace": {"seen": shared}})
    assert "bump" not in module_state.capture([str(job_folder)], probe)["jobhelpers"]  # made by the import

    for name in ("jobconfig", "jobhelpers"):  # a new process imports them afresh
        del sys.modules[name]
    graph = pickle.loads(saved)
    module_state.apply(graph["modules"])
    import jobconfig as again
    import jobhelpers as helpers_again

    assert (again.lr, again.seen) == (0.01, ["batch 0"]) and helpers_again.bump() == 3
    assert graph["namespace"]["seen"] is again.seen  # one object, as before
    assert isinstance(helpers_again.lock, type(threading.Lock()))


def test_modules_the_host_had_before_the_program_are_not_the_jobs(job_folder):
    import jobconfig  # noqa: F401

    module_state.begin()  # as if imported by the worker before the program started
    assert "jobconfig" not in module_state.capture([str(job_folder)], probe)


def test_modules_that_only_look_like_the_jobs_are_left_alone(job_folder, monkeypatch):
    """torch.ops names its file "_ops.py", which resolved against the job's folder would make torch's
    globals the job's; multiprocessing's __mp_main__ is the program itself under another name."""
    import types

    fake = types.ModuleType("lib_ops")
    fake.__file__ = "_ops.py"
    fake.loaded_libraries = set()
    (job_folder / "_ops.py").write_text("")  # even where that name exists in the job's folder
    main = types.ModuleType("__main__")
    main.__file__ = str(job_folder / "train.py")
    main.step = 3
    monkeypatch.setitem(sys.modules, "lib_ops", fake)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setitem(sys.modules, "__mp_main__", main)
    import jobconfig  # noqa: F401

    assert set(module_state.capture([str(job_folder)], probe)) == {"jobconfig"}


def test_a_sys_path_entry_inside_the_job_folder_resolves_on_another_node(job_folder, tmp_path_factory, monkeypatch):
    saved = dumps(context.import_path())
    elsewhere = tmp_path_factory.mktemp("other-node")
    monkeypatch.chdir(elsewhere)
    context.begin()
    sys.path.remove(str(job_folder / "src"))
    pickle.loads(saved)
    assert sys.path[:2] == [str(elsewhere), str(elsewhere / "src")]  # the job's entries, in their order


def test_a_module_that_is_gone_is_a_clear_restore_error(job_folder):
    from backend.proxy.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match="module 'jobgone'.*cannot be imported here"):
        module_state.apply({"jobgone": {"lr": 0.1}})


def test_a_library_is_told_without_resolving_its_path_unless_the_job_lives_beside_it(tmp_path):
    library = os.path.join(sys.prefix, "lib", "python3", "site-packages", "torch", "ops.py")
    assert module_state._installed(library, [str(tmp_path)])
    assert not module_state._installed(str(tmp_path / "helpers.py"), [str(tmp_path)])
    # a job kept under the interpreter's prefix: decided the long way, by in_job_folder
    assert not module_state._installed(os.path.join(sys.prefix, "job", "helpers.py"), [os.path.join(sys.prefix, "job")])


def test_data_attributes_of_a_modules_classes_come_back_and_their_methods_stay_the_imports(job_folder):
    """``AverageMeter.instances`` and ``Meter.count += 1`` in a helper module resumed at their
    import-time values before; an Enum's members and a class's methods are the import's."""
    (job_folder / "jobmeters.py").write_text(
        "import enum\nclass Meter:\n    count = 0\n    instances = []\n    def __init__(self):\n"
        "        Meter.count += 1\n        Meter.instances.append(self)\n    def total(self):\n        return Meter.count\n"
        "class Phase(enum.Enum):\n    TRAIN = 1\n")
    import jobmeters

    meters = [jobmeters.Meter(), jobmeters.Meter()]
    saved = dumps({"modules": module_state.capture([str(job_folder)], probe), "namespace": {"meters": meters}})
    classes = pickle.loads(saved)["modules"]["jobmeters"][module_state.CLASS_ATTRIBUTES]
    assert set(classes) == {"Meter"} and set(classes["Meter"]) == {"count", "instances"}

    del sys.modules["jobmeters"]
    graph = pickle.loads(saved)
    module_state.apply(graph["modules"])
    import jobmeters as again

    assert again.Meter.count == 2 and again.Meter.instances == graph["namespace"]["meters"]
    assert again.Meter.instances[0].total() == 2 and again.Phase.TRAIN.value == 1
    sys.modules.pop("jobmeters", None)


def test_state_held_by_a_modules_functions_comes_back(job_folder):
    """A closure a call made (`next_id = make_counter()`), a mutable default used as storage, a
    function attribute used as a counter, and a default that is one of the module's objects
    (`quiet=_UNSET`): each restarted, or stopped matching its global, after a restore, silently."""
    (job_folder / "jobutil.py").write_text(
        "_UNSET = object()\n"
        "def make_counter():\n    n = 0\n    def inc():\n        nonlocal n\n        n += 1\n        return n\n"
        "    return inc\n"
        "next_id = make_counter()\n"
        "def smooth(x, _hist=[]):\n    _hist.append(x)\n    return sum(_hist[-3:]) / len(_hist[-3:])\n"
        "def tick():\n    tick.calls += 1\n    return tick.calls\n"
        "tick.calls = 0\n"
        "def report(msg, *, quiet=_UNSET):\n    return 'default' if quiet is _UNSET else msg\n"
        "class Meter:\n    def add(self, x, seen=[]):\n        seen.append(x)\n        return len(seen)\n")
    import jobutil

    jobutil.next_id(), jobutil.next_id()
    jobutil.smooth(1.0), jobutil.smooth(2.0)
    jobutil.tick()
    jobutil.Meter().add(1)
    saved = dumps({"modules": module_state.capture([str(job_folder)], probe)})
    del sys.modules["jobutil"]
    module_state.apply(pickle.loads(saved)["modules"])
    import jobutil as again

    try:
        assert (again.next_id(), again.smooth(3.0), again.tick(), again.Meter().add(2)) == (3, 2.0, 2, 2)
        assert again.report("m") == "default"  # the default is the restored _UNSET itself
    finally:
        sys.modules.pop("jobutil", None)


def test_a_warning_a_helper_module_showed_once_is_not_shown_again_after_a_restore(job_folder):
    """``warnings.warn`` in a helper shows a warning once per place (the "default" action), which
    the module's ``__warningregistry__`` remembers. Restored in a process whose filters changed
    another number of times, that registry must still count: not emptied, the warning not shown
    again (a log file captured with ``logging.captureWarnings`` would differ)."""
    import warnings

    (job_folder / "jobwarn.py").write_text(
        "import warnings\ndef normalize(v):\n    warnings.warn('normalize() is deprecated', FutureWarning)\n"
        "    return v / 2\n")
    import jobwarn

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        jobwarn.normalize(1.0), jobwarn.normalize(2.0)
        assert len(shown) == 1
        saved = dumps({"modules": module_state.capture([str(job_folder)], probe)})
    try:
        del sys.modules["jobwarn"]
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("default")
            warnings.simplefilter("default")  # this process's filters have another history
            module_state.apply(pickle.loads(saved)["modules"])
            import jobwarn as again

            again.normalize(3.0)
            assert shown == []
    finally:
        sys.modules.pop("jobwarn", None)


SHARED_UTILS = """
import random

rng = random.Random(7)
calls = 0


def noisy(x):
    global calls
    calls += 1
    return x + rng.random()
"""

USES_SHARED = """
import os, sys
sys.path.insert(0, os.environ["SHARED_UTILS"])
import teamutils

total = 0.0
for step in range(12):
    total += teamutils.noisy(step)
    print(step, teamutils.calls, repr(total))
"""


def test_a_module_on_sys_path_outside_the_job_folder_keeps_its_globals(launcher, tmp_path):
    """A team's shared utilities checkout put on sys.path: its counter and its Random continue."""
    from harness import pick_stops, run_chain, trace_of

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "teamutils.py").write_text(SHARED_UTILS)
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(USES_SHARED)
    env = {"SHARED_UTILS": str(shared)}
    base, trace = trace_of(launcher, [str(job / "train.py")], tmp_path, env)
    assert "11 12 " in base.stdout
    for seed in (1, 2):
        out, _ = run_chain(launcher, [str(job / "train.py")], pick_stops(trace, seed, extra=1),
                           tmp_path / f"ck-{seed}", env)
        assert out == base.stdout


def test_code_a_library_loaded_under_a_made_up_name_is_not_the_jobs(job_folder, tmp_path_factory):
    """torch.compile writes modules to a cache folder and loads them by file: no path search finds
    them by name, so their globals (kernels) are not the job's."""
    import importlib.util

    cache = tmp_path_factory.mktemp("kernel-cache")
    (cache / "c3xk.py").write_text("kernel = object()\n")
    spec = importlib.util.spec_from_file_location("c3xk_generated", cache / "c3xk.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["c3xk_generated"] = module
    try:
        assert "c3xk_generated" not in module_state.job_modules([str(job_folder)])
    finally:
        del sys.modules["c3xk_generated"]
