"""The Ray path's pure parts (no Ray needed): which nodes get an agent, its name, the URL agents
use; and that nothing imports Ray unless ``--ray`` is used."""
from __future__ import annotations

import subprocess
import sys

from backend.ray_cluster.nodes import RayNode, gpu_nodes, node_name
from backend.ray_cluster.placer import reachable_url

NODE_ID = "3f2a9c1e" + "0" * 48


def test_only_alive_nodes_with_gpus_get_an_agent_named_after_the_ray_node():
    table = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0}},
        {"NodeID": NODE_ID, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 4.0}},
        {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 2.0}},
    ]
    assert gpu_nodes(table) == {NODE_ID: RayNode(NODE_ID, "10.0.0.2", 4)}
    assert gpu_nodes(table)[NODE_ID].name == node_name(NODE_ID) == "ray-3f2a9c1e"


def test_agents_reach_a_wildcard_bound_server_at_the_drivers_address():
    assert reachable_url("https://0.0.0.0:8765", "10.1.2.3") == "https://10.1.2.3:8765"
    assert reachable_url("http://127.0.0.1:8765", "10.1.2.3") == "http://127.0.0.1:8765"


def test_nothing_imports_ray_unless_the_ray_path_is_used():
    code = ("import sys, backend.server.main, backend.ray_cluster, singularity_sdk.cli, singularity_sdk.local, "
            "jupyter_ext.serverext; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
