"""The cluster widget shows each GPU's utilisation and memory where NVML sees it; without a GPU
the grid is drawn as before (the GPU part skips with its reason)."""
from __future__ import annotations

import pytest

from backend.agent.devices import discover_gpus
from jupyter_ext.cluster_widget import ClusterWidget, cluster_html
from jupyter_ext.nvml import Load, sample
from singularity_sdk.protocol import DeviceInfo, NodeInfo, NodeState


def test_the_grid_shows_a_device_load_only_where_one_is_known():
    node = NodeInfo(name="n1", state=NodeState.READY, used={0: "j-1"},
                    devices=[DeviceInfo(index=0, kind="cuda", name="GPU", uuid="GPU-a"),
                             DeviceInfo(index=1, kind="cuda", name="GPU", uuid="GPU-b")])
    grid = cluster_html([node], {"j-1": "train"}, {"GPU-a": Load(37, 3 * 2**30, 80 * 2**30)})
    assert grid.count("singularity-load") == 1 and "37% - 3.0/80 GiB" in grid
    assert "singularity-load" not in cluster_html([node], {"j-1": "train"}, {})
    assert sample(["GPU-not-on-this-machine"]) == {}


@pytest.mark.skipif(not discover_gpus(), reason="no GPU visible through NVML on this machine")
def test_the_cluster_widget_shows_gpu_load(jclient):
    # one entry per node's device: the test cluster's two agents on a one-GPU machine both offer it
    gpus = [d.uuid for n in jclient.nodes() for d in n.devices if d.kind == "cuda"]
    if not gpus:
        pytest.skip("the test cluster's agents registered no GPUs")
    w = ClusterWidget(jclient, poll_s=5.0)
    try:
        assert w.grid.value.count("singularity-load") == len(gpus)
    finally:
        w.close()
