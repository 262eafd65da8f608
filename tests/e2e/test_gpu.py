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


NCCL_DDP = '''
import hashlib, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(0)  # every rank sees its own device as cuda:0
torch.manual_seed(0)
model = nn.Linear(64, 8).cuda()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator(device="cuda").manual_seed(rank)
for step in range(30):
    loss = ddp(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, repr(loss.item()), flush=True)
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
dist.destroy_process_group()
digest
'''


@needs_gpu
def test_nccl_ddp_two_ranks_spliced_on_one_gpu_resizes_exactly(tmp_path):
    """W = 2 NCCL ranks on one GPU (S = 2) against the same job moved to 1 -> 1 device through a
    preemption: identical losses and parameters (the only GPU path this suite can run on one GPU)."""
    from exactness import rank_lines, wait_for_lines
    from singularity_sdk import JobState, LocalCluster

    with LocalCluster(nodes=1, home=tmp_path / "h") as cluster, cluster.client() as client:
        plain = client.submit(NCCL_DDP, gpus=1, ranks=2, name="nccl-plain")
        assert plain.wait(300) == JobState.SUCCEEDED, plain.info.error
        moved = client.submit(NCCL_DDP, gpus=1, ranks=2, name="nccl-preempted")
        wait_for_lines(moved, 20)
        moved.preempt(timeout=120)
        moved.resume()
        assert moved.wait(300) == JobState.SUCCEEDED, moved.info.error
        assert (rank_lines(moved), moved.result()) == (rank_lines(plain), plain.result())


CUDNN_CONV = (
    "import torch, torch.nn as nn\n"
    "torch.manual_seed(0)\n"
    "torch.backends.cudnn.benchmark = False\n"
    "torch.backends.cudnn.deterministic = True\n"
    "net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),\n"
    "                    nn.Conv2d(16, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).cuda()\n"
    "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n"
    "g = torch.Generator(device='cuda').manual_seed(1)\n"
    "for step in range(24):\n"
    "    x = torch.randn(16, 3, 32, 32, device='cuda', generator=g)\n"
    "    loss = net(x).pow(2).mean()\n"
    "    opt.zero_grad(set_to_none=True)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    print(step, repr(loss.item()), flush=True)\n"
)


@needs_gpu
def test_a_cudnn_convolutional_model_resumes_exactly_at_every_third_step(tmp_path):
    """cuDNN convolutions, BatchNorm running stats, AdamW state and a CUDA generator, all on the
    device, stopped and restored in fresh processes: the losses are bitwise those of one run."""
    script = tmp_path / "conv.py"
    script.write_text(CUDNN_CONV)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    ckpt = tmp_path / "ck"
    run = [sys.executable, "-m", "backend.proxy", str(script), "--checkpoint-dir", str(ckpt)]
    out, restore = "", []
    for stop in (4, 11, 19):
        part = subprocess.run(run + restore + ["--stop-at-step", str(stop)], capture_output=True, text=True)
        assert part.returncode == 75, part.stderr
        out += part.stdout
        restore = ["--restore"]
    last = subprocess.run(run + restore, capture_output=True, text=True)
    assert last.returncode == 0, last.stderr
    assert out + last.stdout == plain


@needs_gpu
def test_a_sandboxed_job_opens_only_its_own_gpus_device_file():
    from backend.agent import sandbox
    from backend.agent.devices import gpu_minor_numbers

    bwrap = sandbox.choose()
    if bwrap is None:
        pytest.skip("no working bwrap here (make setup installs bubblewrap)")
    minors = gpu_minor_numbers()
    assert minors, "NVML gave no minor numbers on a machine with a GPU"
    first = min(minors.values())
    probe = f"open('/dev/nvidia{first}', 'rb').close(); print('open')"
    for own, expected in (({first}, "open"), (set(), "PermissionError")):
        import os

        r, w = os.pipe()
        try:
            cmd = sandbox.command(bwrap, [sys.executable, "-c", probe], sandbox.plan([], [], sandbox.gpu_files_to_mask(own)), w)
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, pass_fds=(w,))
        finally:
            os.close(r)
            os.close(w)
        assert expected in done.stdout + done.stderr, (own, done.stdout, done.stderr)


@needs_gpu
def test_device_storages_reach_the_host_through_the_page_locked_chunks():
    """host_copy.to_host: the bytes of storages smaller than, equal to and spanning several
    chunks (odd sizes, views) are those `.cpu()` gives, and the staging chunks are page-locked."""
    from backend.proxy.checkpoint import dedup
    from backend.proxy.checkpoint.host_copy import staging_chunks, to_host

    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = 1 << 20
    for n in (0, 1, chunk - 1, chunk, chunk + 3, 5 * chunk + 7):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        assert to_host(t.untyped_storage(), chunk_bytes=chunk).tobytes() == t.cpu().numpy().tobytes(), n
    view = torch.randn(3000, 700, device="cuda", generator=g)[7:]
    assert bytes(dedup.storage_bytes(view.untyped_storage())) == bytes(view.untyped_storage().cpu())
    assert all(c.is_pinned() for c in staging_chunks())


@needs_gpu
def test_a_checkpoint_of_cuda_tensors_round_trips_through_blobs(tmp_path):
    """Blob and inline storages of CUDA tensors (a model and its optimizer, views sharing a
    storage) are written through the staging chunks and load back equal, on the device."""
    import io

    from backend.proxy.checkpoint import dedup

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 512, device="cuda")).sum().backward()
    opt.step()
    big = torch.randn(300_000, device="cuda")
    state = {"net": net.state_dict(), "opt": opt.state_dict(), "big": big, "view": big[10:20]}
    buf = io.BytesIO()
    stats = dedup.dump(state, buf, dedup.BlobStore(tmp_path / "blobs"))
    assert stats.blob_bytes_written >= big.nbytes and stats.inline_bytes > 0
    back = dedup.load(io.BytesIO(buf.getvalue()), dedup.BlobStore(tmp_path / "blobs"))
    assert back["big"].is_cuda and torch.equal(back["big"], big)
    assert back["view"].untyped_storage().data_ptr() == back["big"].untyped_storage().data_ptr()
    for k, v in state["net"].items():
        assert torch.equal(back["net"][k], v), k
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@needs_gpu
def test_a_snapshot_holds_one_host_copy_of_a_frozen_cuda_parameter(tmp_path):
    """Behind the loop, a frozen CUDA parameter's blob waits as the host copy `to_host` made, not
    as a second copy of it, and the checkpoint written from it loads back equal."""
    from backend.proxy.checkpoint.store import CheckpointStore
    from backend.proxy.engine import background
    from backend.proxy.engine import state as engine_state

    torch.manual_seed(0)
    frozen = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"), requires_grad=False)
    graph = {"frozen": frozen, "head": torch.randn(64, device="cuda")}
    snap = background.Snapshot()
    engine_state.save_graph(graph, snap, one_rank=True)
    held = [data for _n, data in snap.blobs.pending.values()]
    assert len(held) == 1 and isinstance(held[0], memoryview), held  # the host array itself
    store = CheckpointStore(tmp_path / "ck")
    store.write(1, 0, 1, snap.write_to)
    ref = store.latest(contents=True)
    assert ref is not None and sum(b["bytes"] for b in ref.blobs.values()) == frozen.nbytes
