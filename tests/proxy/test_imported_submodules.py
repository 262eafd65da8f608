"""``import a.b`` before a checkpoint: after a restore ``a.b`` is there again (the checkpoint
saves the module ``a`` by name; the submodule is an import's side effect, which a restore
crashed without: "module 'xml' has no attribute 'sax'")."""
from __future__ import annotations

import textwrap

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
