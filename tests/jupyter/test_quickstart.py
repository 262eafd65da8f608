"""examples/quickstart.ipynb, executed cell by cell in a real kernel with nbclient."""
from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from jupyter_helpers import ROOT, kernel_env

NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_quickstart_notebook_runs_and_resumes_exactly(jcluster, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    env = kernel_env(jcluster)
    client.execute(env=env)
    code = [c for c in nb.cells if c.cell_type == "code"]
    by_source = {c.source.splitlines()[0] if c.source else "": c for c in code}
    train = next(c for c in code if "--name quickstart " in c.source)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in train.outputs), \
        "the training cell shows the live widget"
    attach = by_source["%singularity attach job --wait"]
    assert "step 59" in outputs_text(attach)
    summary = next(c for c in code if c.source.startswith("resumed_losses"))
    assert "preempted: True  resumed: True  steps: 60" in outputs_text(summary)
    final = next(c for c in code if c.source.startswith("reference_losses"))
    assert "identical: True" in outputs_text(final)
