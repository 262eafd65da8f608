"""Files a program pickles after a restore are byte-identical to the uninterrupted run's.

A history of dicts (``{"epoch": e, "val/acc": a}``) pickled at every step mixes entries made
before the stop, restored from the checkpoint, with entries made after it. Pickle writes a
string once and refers back to it (by identity), so the restored keys must be the very objects
the code's constants are, or the file holds each key twice and its bytes differ (it loads equal).
Covered: the program's own string constants (any text) and identifier-like constants of helper
modules in the job's folder (`canonical_strings.py`).
"""
from __future__ import annotations

import pickle
import shutil
import sys
import textwrap

from harness import pick_stops, run_chain, trace_of

from backend.proxy.engine import canonical_strings, state

TRAIN = """
import os, pickle, sys
import torch
import metrics

HERE = os.path.dirname(os.path.abspath(__file__))


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.history = []

    def epoch(self, e):
        for i in range(3):
            x = torch.randn(4, 3)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.history.append({"epoch": e, "step": i, "train loss": round(loss.item(), 6)})
            metrics.record(self.history, e, i)
            print(e, i, round(loss.item(), 6))


def main():
    t = Trainer()
    log = {"runs": [], "val/acc": []}
    for e in range(4):
        t.epoch(e)
        log["val/acc"].append({"epoch": e, "val/acc": e * 0.25, "tag": "val/acc"})
        with open(os.path.join(HERE, "history.pkl"), "wb") as f:
            pickle.dump((t.history, log), f)
        torch.save({"history": t.history, "log": log, "model": t.model.state_dict(),
                    "opt": t.opt.state_dict()}, os.path.join(HERE, "state.pt"))
    print("done", len(t.history))


if __name__ == "__main__":
    main()
"""

METRICS = """
def record(history, epoch, step):
    history.append(dict(kind="metric", epoch=epoch, step=step))
"""


def _folder(where, name):
    folder = where / name
    folder.mkdir()
    (folder / "train.py").write_text(textwrap.dedent(TRAIN))
    (folder / "metrics.py").write_text(textwrap.dedent(METRICS))
    return folder


def test_pickled_histories_after_a_restore_are_byte_identical(launcher, tmp_path):
    base_dir = _folder(tmp_path, "base")
    base, trace = trace_of(launcher, [str(base_dir / "train.py")], tmp_path)
    expected = {name: (base_dir / name).read_bytes() for name in ("history.pkl", "state.pt")}
    for seed in (1, 2):
        folder = _folder(tmp_path, f"chain{seed}")
        stops = pick_stops(trace, seed, extra=2)
        out, _ = run_chain(launcher, [str(folder / "train.py")], stops, tmp_path / f"ck{seed}")
        assert out == base.stdout
        for name, data in expected.items():
            assert (folder / name).read_bytes() == data, f"{name} differs after stops {stops}"
        shutil.rmtree(folder)


HISTORY = "history = [{'epoch': e, 'val/acc': e / 4} for e in range(3)]"


def test_a_checkpoints_strings_come_back_as_the_objects_of_the_code_compiled_again(tmp_path):
    code = compile(HISTORY, "<cell>", "exec")
    ns: dict = {}
    exec(code, ns)
    path = tmp_path / "rank-0.pt"
    with open(path, "wb") as f:
        state.save_graph({"history": ns["history"]}, f, header=canonical_strings.header_for(code, ()))
    again = compile(HISTORY, "<cell>", "exec")
    with canonical_strings.restoring(again):
        history = state._read_graph(path, tmp_path / "no-blobs")["history"]
    table = canonical_strings.program_table(again)
    assert table["val/acc"] is not canonical_strings.program_table(code)["val/acc"]  # two compiles
    for entry in history:
        epoch, acc = entry
        assert acc is table["val/acc"] and epoch is sys.intern("epoch")
    # without the code (and in a file of an earlier engine, which has no header) it loads equal
    assert state._read_graph(path, tmp_path / "no-blobs")["history"] == ns["history"]
    path.write_bytes(pickle.dumps({"history": ns["history"]}, protocol=4))
    assert state._read_graph(path, tmp_path / "no-blobs")["history"] == ns["history"]


LATE_STATE = """
import os, torch
HERE = os.path.dirname(os.path.abspath(__file__))
torch.manual_seed(5)
body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=1e-2)
for i in range(10):
    h = body(torch.randn(8, 4))
    loss = h.pow(2).mean() if i < 5 else head(h).pow(2).mean()  # head's Adam state begins at 5
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(i, loss.item().hex())
torch.save(opt.state_dict(), os.path.join(HERE, "opt.pt"))
"""


def test_an_optimizers_state_made_after_a_restore_saves_with_the_same_bytes(launcher, tmp_path):
    """Adam's state for parameters that first get a gradient after the restore is keyed by
    torch's own constants (``"exp_avg"``); the restored entries must be keyed by those too."""
    folders = {}
    for name in ("base", "chain"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "late.py").write_text(textwrap.dedent(LATE_STATE))
    base, trace = trace_of(launcher, [str(folders["base"] / "late.py")], tmp_path)
    stops = [t["step"] for t in trace if t["kind"] == "loop"][2:4]
    out, _ = run_chain(launcher, [str(folders["chain"] / "late.py")], stops, tmp_path / "ck")
    assert out == base.stdout
    assert (folders["chain"] / "opt.pt").read_bytes() == (folders["base"] / "opt.pt").read_bytes()


OWN_RESUME = """
import os, sys, torch
HERE = os.path.dirname(os.path.abspath(__file__))
CKPT = os.path.join(HERE, "own.pt")
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
start = 0
if os.path.exists(CKPT):  # the script's own resume: its keys are torch.load's strings
    ck = torch.load(CKPT)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    start = ck["step"] + 1
for step in range(start, start + 8):
    loss = model(torch.randn(5, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, loss.item().hex())
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT)
"""


def test_a_jobs_own_checkpoint_after_its_own_resume_saves_with_the_same_bytes(launcher, tmp_path):
    """After ``opt.load_state_dict(torch.load(...))`` the optimizer's keys are torch.load's
    strings, not torch's constants; a restore that made them the constants had the next
    ``torch.save`` refer back to ``"step"`` where the uninterrupted run wrote it again."""
    folders = {}
    for name in ("base", "chain"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "own.py").write_text(textwrap.dedent(OWN_RESUME))
        first = launcher.run([str(folders[name] / "own.py"), "--checkpoint-dir", str(tmp_path / f"first-{name}")])
        assert first.rc == 0, first.describe()  # the job's first run, which wrote its own.pt
    base, trace = trace_of(launcher, [str(folders["base"] / "own.py")], tmp_path)
    stops = [t["step"] for t in trace if t["kind"] == "loop"][2:4]
    out, _ = run_chain(launcher, [str(folders["chain"] / "own.py")], stops, tmp_path / "ck")
    assert out == base.stdout
    assert (folders["chain"] / "own.pt").read_bytes() == (folders["base"] / "own.pt").read_bytes()
