"""``import a.b`` before a checkpoint: after a restore ``a.b`` is there again (the checkpoint
saves the module ``a`` by name; the submodule is an import's side effect, which a restore
crashed without: "module 'xml' has no attribute 'sax'")."""
from __future__ import annotations

import json
import textwrap

import pytest

from harness import run_chain, trace_of

SCRIPT = """
import email.mime.text
import xml.sax.saxutils


def main():
    import json.tool  # in a function too
    for step in range(6):
        print(step, xml.sax.saxutils.escape(f"<{step}>"), email.mime.text.MIMEText("x").get_content_type(),
              json.tool.__name__)


main()
"""


def test_submodules_imported_before_a_checkpoint_are_there_after_the_restore(launcher, tmp_path):
    (tmp_path / "imports.py").write_text(textwrap.dedent(SCRIPT))
    target = [str(tmp_path / "imports.py")]
    base, trace = trace_of(launcher, target, tmp_path)
    assert base.stdout.splitlines()[1] == "1 &lt;1&gt; text/plain json.tool"
    stops = [t["step"] for t in trace if t["kind"] == "loop"][1::2]
    out, _ = run_chain(launcher, target, stops, tmp_path / "ck")
    assert out == base.stdout


def test_what_a_library_prints_as_it_is_imported_is_not_printed_again_at_a_restore(launcher, tmp_path):
    """transformers prints ``[INFO] Running in WANDB offline mode`` when its W&B integration is
    imported with ``WANDB_MODE=offline`` (every Trainer script that sets it): a restore imports
    the library again, and the line was printed again at every restore."""
    pytest.importorskip("transformers", reason="needs the trainers extra (transformers)")
    script = tmp_path / "train.py"
    script.write_text("import transformers.integrations.integration_utils\n"
                      "for step in range(5):\n"
                      "    print('step', step)\n")
    env = {"WANDB_MODE": "offline"}
    base = launcher.run([str(script), "--checkpoint-dir", str(tmp_path / "base"), "--trace", str(tmp_path / "t")], env)
    assert base.rc == 0 and base.stdout.count("WANDB offline") == 1, base.describe()
    trace = [json.loads(line) for line in (tmp_path / "t").read_text().splitlines()]
    loops = [t["step"] for t in trace if t["kind"] == "loop"]
    out, runs = run_chain(launcher, [str(script)], [loops[1], loops[3]], tmp_path / "ck", env=env)
    assert out == base.stdout, runs[-1].describe()
