"""Measurements quoted in docs/checkpoint-format.md (not a test; run by hand).

    python tests/proxy/bench_proxy.py

1. steady-state overhead on a ~4 ms training step, plain exec vs the engine, interleaved pairs;
2. the per-iteration cost of a safe point on an empty loop;
3. the cost of repositioning a DataLoader at batch k: index skip (num_workers=0) vs replay
   through the workers (num_workers=2) vs replay in process;
4. checkpoint write time and size for a ~1.3 M-parameter model with Adam.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from backend.proxy import CheckpointStore, Controller, ResumableProgram
from backend.proxy.engine.iterators import _advance_dataloader

TRAIN = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(256, 256)
y = torch.randn(256, 1)
for step in range(STEPS):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
"""


def overhead(tmp: Path, steps: int = 300, pairs: int = 9) -> None:
    src = TRAIN.replace("STEPS", str(steps))
    plain_code = compile(src, "<plain>", "exec")
    program = ResumableProgram.from_source(src, "<engine>")
    store = CheckpointStore(tmp / "ck")

    def plain() -> float:
        t = time.perf_counter()
        exec(plain_code, {"__name__": "__main__"})
        return time.perf_counter() - t

    def engine() -> float:
        t = time.perf_counter()
        program.run({"__name__": "__main__"}, Controller(store))
        return time.perf_counter() - t

    plain(), engine()
    ratios, p_times, e_times = [], [], []
    for i in range(pairs):
        a, b = (plain(), engine()) if i % 2 == 0 else (engine(), plain())[::-1]
        p_times.append(a)
        e_times.append(b)
        ratios.append(b / a)
    step_ms = statistics.median(p_times) / steps * 1e3
    print(f"training step {step_ms:.2f} ms: engine/plain median ratio {statistics.median(ratios):.4f} "
          f"(min-time ratio {min(e_times) / min(p_times):.4f}) over {pairs} interleaved pairs")


def per_iteration(tmp: Path, n: int = 1_000_000) -> None:
    for kind, src in (("for", f"for i in range({n}):\n    pass\n"),
                      ("while", f"i = 0\nwhile i < {n}:\n    i += 1\n")):
        code = compile(src, "<p>", "exec")
        program = ResumableProgram.from_source(src)
        best_p = best_e = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            exec(code, {})
            best_p = min(best_p, time.perf_counter() - t)
            t = time.perf_counter()
            program.run({}, Controller(CheckpointStore(tmp / "ck")))
            best_e = min(best_e, time.perf_counter() - t)
        print(f"empty {kind} loop: {(best_e - best_p) / n * 1e9:.0f} ns added per iteration")


class Slow(Dataset):
    """Each sample costs ~0.5 ms to load, like a small image decode."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0005:
            pass
        return torch.full((8,), float(i))


def dataloader_reposition(k: int = 100) -> None:
    for workers, mode in ((0, "skip"), (0, "replay"), (2, "replay")):
        loader = DataLoader(Slow(), batch_size=8, shuffle=True, num_workers=workers)
        t = time.perf_counter()
        it = _advance_dataloader(loader, mode, k, line=0, text="loader")
        next(it)
        took = time.perf_counter() - t
        del it
        print(f"DataLoader num_workers={workers} {mode:6s}: to batch {k} in {took * 1e3:8.1f} ms "
              f"({took / (k + 1) * 1e3:.2f} ms per batch)")


def checkpoint_cost(tmp: Path) -> None:
    src = TRAIN.replace("STEPS", "5")
    events: list[tuple[str, dict]] = []
    ctl = Controller(CheckpointStore(tmp / "ck2"), on_event=lambda k, d: events.append((k, d)))
    ctl.checkpoint_at_step(12, "continue")
    ResumableProgram.from_source(src).run({"__name__": "__main__"}, ctl)
    done = [d for k, d in events if k == "checkpointed"][0]
    print(f"checkpoint of a 1.3 M-parameter model + Adam: {done['bytes'] / 1e6:.1f} MB in "
          f"{done['seconds'] * 1e3:.0f} ms (wait for the safe point {done['wait_s'] * 1e3:.2f} ms)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        overhead(Path(d))
        per_iteration(Path(d))
        dataloader_reposition()
        checkpoint_cost(Path(d))
