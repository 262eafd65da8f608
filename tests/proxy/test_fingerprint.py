"""What exactness depends on, through the CLI: a checkpoint records the fingerprint, a restore
re-applies the deterministic settings the program had set, refuses a process that differs
(naming the difference), and a checkpoint of another format is refused naming who wrote it."""
from __future__ import annotations

import json
import sys

import pytest

from backend.proxy import CheckpointError, CheckpointStore
from backend.proxy.checkpoint import fingerprint
from backend.proxy.engine import state

SCRIPT = """\
import time
import torch
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = True
for i in range(40):
    time.sleep(0.05)
    print(i, torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark, flush=True)
"""


@pytest.fixture()
def stopped(launcher, tmp_path):
    """The script stopped at a checkpoint after its settings were made (and a progress tick)."""
    script = tmp_path / "settings.py"
    script.write_text(SCRIPT)
    ck = tmp_path / "ck"
    run = launcher.run([str(script), "--checkpoint-dir", str(ck), "--stop-at-step", "30"])
    assert run.rc == 75, run.describe()
    return script, ck, run


def test_exactness_event_warns_about_cudnn_benchmark_and_restore_reapplies_settings(launcher, stopped):
    script, ck, run = stopped
    report = run.events("exactness")[-1][1]  # the latest: settings changed after the first
    assert report["fingerprint"]["python"] and report["fingerprint"]["torch"]
    assert report["fingerprint"]["settings"]["cudnn_benchmark"] is True
    assert any("cudnn.benchmark is on" in w for w in report["warnings"]) and report["gpu_exact"] is False
    # The statements that set them are skipped on restore; the settings come back all the same.
    resumed = launcher.run([str(script), "--checkpoint-dir", str(ck), "--restore"])
    assert resumed.rc == 0, resumed.describe()
    lines = resumed.stdout.splitlines()
    assert lines and all(line.endswith("True True") for line in lines), lines


def test_restore_in_a_process_that_differs_is_refused_naming_the_difference(launcher, stopped):
    script, ck, _ = stopped
    env = {fingerprint.OVERRIDE_ENV: json.dumps({"torch": "0.0.1-other"})}
    refused = launcher.run([str(script), "--checkpoint-dir", str(ck), "--restore"], env=env)
    assert refused.rc == 2, refused.describe()
    assert "cannot resume exactly here: torch " in refused.stderr
    assert "(checkpoint) vs 0.0.1-other (here)" in refused.stderr
    assert refused.stdout == ""  # refused before running anything


def test_checkpoint_of_another_format_is_refused_naming_its_writer(stopped, monkeypatch):
    _, ck, _ = stopped
    ref = CheckpointStore(ck).latest()
    assert ref is not None
    monkeypatch.setattr(state, "GRAPH_FORMAT", state.GRAPH_FORMAT + 1)  # as a newer engine would read it
    with pytest.raises(CheckpointError) as err:
        state.load_graph(ref, 0, {}, "irrelevant")
    text = str(err.value)
    assert f"in checkpoint format {state.GRAPH_FORMAT - 1}" in text
    assert f"this engine reads format {state.GRAPH_FORMAT}" in text
    assert "written by engine " in text and "start the job over" in text


def test_differences_compare_only_what_the_checkpoint_depends_on():
    recorded = {"python": "3.11.7", "torch": None, "numpy": "2.0.0", "device": "cpu"}
    assert fingerprint.differences(recorded, {"python": "3.11.7", "torch": "9", "numpy": "2.0.0", "device": "cpu"}) == []
    assert fingerprint.differences(recorded, {"python": "3.12.1", "numpy": "2.0.0", "device": "NVIDIA H200"}) == [
        "python 3.11.7 (checkpoint) vs 3.12.1 (here)", "device cpu (checkpoint) vs NVIDIA H200 (here)"]
    assert fingerprint.matches(None, None) and not fingerprint.matches(recorded, None)


def test_rewritten_library_versions_are_compared_on_restore_not_by_node_placement():
    recorded = {"python": "3.11.0", "libraries": {"transformers": "4.46.0"}}
    assert fingerprint.differences(recorded, {"python": "3.11.0", "libraries": {"transformers": "4.46.0"}}) == []
    assert fingerprint.differences(recorded, {"python": "3.11.0", "libraries": {"transformers": "4.47.0"}}) == [
        "transformers 4.46.0 (checkpoint) vs 4.47.0 (here)"]
    assert fingerprint.differences(recorded, {"python": "3.11.0", "libraries": {}}) == [
        "transformers 4.46.0 (checkpoint) vs not installed (here)"]
    # a node's fingerprint lists no libraries: the scheduler does not hold a job back for them
    assert fingerprint.matches(recorded, {"python": "3.11.0", "torch": None, "numpy": None, "device": "cpu"})


class _FakeNvml:
    """Where NVML ends and the machine begins (no GPU here): a driver that fails ``failures``
    times with ``error`` before it answers."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    def __init__(self, error: type, failures: int) -> None:
        self.error, self.failures, self.inits = error, failures, 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.inits <= self.failures:
            raise self.error()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H200"


@pytest.mark.parametrize("visible", [None, "0"])
def test_the_device_model_is_asked_once_and_a_passing_nvml_failure_is_not_remembered(monkeypatch, visible):
    """Every checkpoint records the device model (twice): NVML is asked once per process, but a
    hiccup must not leave the job's checkpoints recorded as CPU ones, placeable on any node."""
    monkeypatch.setattr(fingerprint, "_nvml_names", {})
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = _FakeNvml(_FakeNvml.NVMLError, failures=1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert fingerprint.capture()["device"] == "cpu"  # the hiccup
    assert [fingerprint.capture()["device"] for _ in range(3)] == ["NVIDIA H200"] * 3
    assert nvml.inits == 2


def test_a_machine_without_an_nvidia_driver_is_asked_once(monkeypatch):
    monkeypatch.setattr(fingerprint, "_nvml_names", {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = _FakeNvml(_FakeNvml.NVMLError_LibraryNotFound, failures=10)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert [fingerprint.capture()["device"] for _ in range(3)] == ["cpu"] * 3
    assert nvml.inits == 1


def test_a_library_reports_the_same_version_before_and_after_its_import(tmp_path, monkeypatch):
    """A CUDA build of torch is 2.11.0 to pip and 2.11.0+cu130 to torch.__version__: the restoring
    process (before importing) and the agent must read what the checkpoint recorded (after), or
    every restore on a GPU machine is refused."""
    import importlib
    import subprocess
    import sys

    import torch

    pkg = tmp_path / "cudabuild"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .version import __version__\n")
    (pkg / "version.py").write_text("__all__ = ['__version__']\n__version__ = '1.0.0+cu130'\n")
    dist = tmp_path / "cudabuild-1.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cudabuild\nVersion: 1.0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = fingerprint.library_version("cudabuild")
    assert "cudabuild" not in sys.modules
    assert before == importlib.import_module("cudabuild").__version__ == fingerprint.library_version("cudabuild")
    assert fingerprint.here()["torch"] == torch.__version__ == fingerprint.node([])["torch"]
    fresh = subprocess.run([sys.executable, "-c", "import sys; from backend.proxy.checkpoint import fingerprint as f;"
                            "print(f.here()['torch'], f.here()['numpy'], 'torch' in sys.modules)"],
                           capture_output=True, text=True, check=True).stdout.split()
    import numpy

    assert fresh == [torch.__version__, numpy.__version__, "False"]
