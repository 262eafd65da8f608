"""docs/deploy.md's KubeRay manifest and Slurm script, checked without a cluster (neither runs
here): the manifest is valid YAML of the shape KubeRay reads, each group declares to Ray the GPUs
it asks Kubernetes for, the head none; the script is valid bash; every ``serve`` has a store."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def _serves(text: str) -> list[str]:
    """Each ``singularityctl serve`` command in ``text``, its continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line[line.index("singularityctl serve"):] for line in joined.splitlines() if "singularityctl serve" in line]


def test_the_kuberay_manifest_gives_ray_the_gpus_it_asks_kubernetes_for():
    [manifest] = _blocks("yaml")
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    [cluster] = [d for d in docs if d["kind"] == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0", "the head only schedules: no agent there"
    assert not any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                   for c in head["template"]["spec"]["containers"])
    serve = [c for c in head["template"]["spec"]["containers"] if c.get("command", [])[:2] == ["singularityctl", "serve"]]
    assert len(serve) == 1
    command = serve[0]["command"]
    assert command[command.index("--ray") + 1] == "auto" and "--store" in command
    mounts = {c["name"]: {m["mountPath"] for m in c.get("volumeMounts", [])} for c in head["template"]["spec"]["containers"]}
    assert all("/tmp/ray" in m for m in mounts.values()), "the driver needs the head's /tmp/ray"
    groups = cluster["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        [container] = group["template"]["spec"]["containers"]
        assert group["rayStartParams"]["num-gpus"] == container["resources"]["limits"]["nvidia.com/gpu"]
    for container in [*head["template"]["spec"]["containers"], *(g["template"]["spec"]["containers"][0] for g in groups)]:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["targetPort"] == serve[0]["ports"][0]["containerPort"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_the_slurm_script_is_valid_bash_and_serves_with_a_store():
    [script] = _blocks("bash")
    assert script.startswith("#!/bin/bash\n#SBATCH")
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    assert "RAY_AUTH_MODE=token" in script and "ray start --head" in script
    [serve] = _serves(script)
    assert "--store" in serve and "--ray" in serve


def test_every_serve_on_more_than_one_node_passes_a_store():
    serves = [s for block in _blocks(r"\w*") for s in _serves(block)]
    assert len(serves) >= 3
    assert all("--store" in s for s in serves), [s for s in serves if "--store" not in s]
