"""Device -> host copies of a checkpoint's storages, the ways side by side in one run (needs a GPU).

    python bench/gpu_copy.py [--sizes 256,1024,4096] [--reps 5]

For each size (MiB) one CUDA storage is copied to host memory:
- ``pageable``: ``storage.cpu()``, the driver staging through its own buffers (what checkpoints did);
- ``fresh pinned``: a new page-locked buffer per copy, as a pinned-per-checkpoint design would;
- ``reused pinned``: into a page-locked buffer allocated once (the link's ceiling; holds the
  whole size locked for the job's life, which is why it is not the design);
- ``staged``: `host_copy.to_host`, two reused 64 MiB page-locked chunks double-buffered into an
  ordinary host array (what checkpoints do now);
- ``registered``: a fresh ordinary host array page-locked for the copy (``cudaHostRegister``),
  copied into directly, then unlocked.
Host -> device for the restore is timed too (pageable and reused pinned).  Medians of ``reps``;
GB/s counts bytes copied once; the ratio column is each way's time over ``reused pinned``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backend.proxy.checkpoint.host_copy import to_host  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: allocator caches, the staging chunks
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def registered_copy(src: torch.Tensor) -> np.ndarray:
    """Page-lock a fresh host array, copy into it at the pinned speed, unlock it."""
    out = np.empty(src.numel(), dtype=np.uint8)
    cudart = torch.cuda.cudart()
    ptr = out.ctypes.data
    err = cudart.cudaHostRegister(ptr, out.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    try:
        torch.from_numpy(out).copy_(src)
    finally:
        cudart.cudaHostUnregister(ptr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,4096", help="MiB per storage, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark measures device -> host copies")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(f"{'size':>9} {'way':>14} {'seconds':>9} {'GB/s':>7} {'/ reused pinned':>15}")
    for mib in (int(s) for s in args.sizes.split(",")):
        n = mib << 20
        dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        storage = dev.untyped_storage()
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        assert bytes(to_host(storage)[:4096]) == bytes(dev[:4096].cpu().numpy())
        assert bytes(registered_copy(dev)[-4096:]) == bytes(dev[-4096:].cpu().numpy())
        # fresh pinned must not be served by the caching host allocator: empty it each time
        empty = (getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
                 or (lambda: None))
        ways = {
            "pageable": lambda: storage.cpu(),
            "fresh pinned": lambda: (torch.empty(n, dtype=torch.uint8, pin_memory=True).copy_(dev).data_ptr(), empty()),
            "reused pinned": lambda: pinned.copy_(dev),
            "staged": lambda: to_host(storage),
            "registered": lambda: registered_copy(dev),
            "h2d pageable": lambda: dev.copy_(pageable),
            "h2d pinned": lambda: dev.copy_(pinned),
        }
        results = {name: timed(fn, args.reps) for name, fn in ways.items()}
        ceiling = results["reused pinned"]
        for name, s in results.items():
            base = results["h2d pinned"] if name.startswith("h2d") else ceiling
            print(f"{mib:>5} MiB {name:>14} {s:>9.4f} {n / s / 1e9:>7.1f} {s / base:>14.2f}x", flush=True)
        del dev, storage, pinned, pageable
        torch.cuda.empty_cache()
        empty()


if __name__ == "__main__":
    main()
