"""The GPU paths: NVML discovery and CUDA tensors in checkpoints. They run where a GPU exists
and skip cleanly elsewhere (CPU slots stand in for devices in every other test)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backend.agent.devices import discover, discover_gpus

torch = pytest.importorskip("torch")
HAS_GPU = bool(discover_gpus())
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU visible through NVML on this machine")


def test_without_nvml_the_agent_offers_cpu_slots_quietly():
    if HAS_GPU:
        pytest.skip("this machine has a GPU; the CPU fallback is what every other test exercises")
    devices = discover(3)
    assert [(d.index, d.kind) for d in devices] == [(0, "cpu"), (1, "cpu"), (2, "cpu")]


@needs_gpu
def test_nvml_reports_name_uuid_and_memory():
    gpus = discover_gpus()
    assert all(g.kind == "cuda" and g.uuid and g.memory_bytes and g.memory_bytes > 0 for g in gpus)


@needs_gpu
def test_cuda_tensors_checkpoint_and_resume_exactly(tmp_path):
    script = tmp_path / "cuda_train.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "w = torch.randn(64, 64, device=dev)\n"
        "for step in range(20):\n"
        "    w = torch.tanh(w @ torch.randn(64, 64, device=dev))\n"
        "    print(step, repr(w.double().sum().item()), w.device.type, flush=True)\n")
    run = [sys.executable, "-m", "backend.proxy", str(script), "--checkpoint-dir", str(tmp_path / "ck")]
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    first = subprocess.run(run + ["--stop-at-step", "9"], capture_output=True, text=True)
    assert first.returncode == 75, first.stderr
    second = subprocess.run(run + ["--restore"], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert first.stdout + second.stdout == plain
    assert "cuda" in plain
