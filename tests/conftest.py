"""Fixtures: real LocalClusters (server + agent processes) in temporary homes."""
from __future__ import annotations

from pathlib import Path

import pytest

from singularity_sdk import LocalCluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    """One 2-node x 2-device cluster shared by a test module (starting one takes ~0.5 s)."""
    with LocalCluster(nodes=2, devices_per_node=2) as c:
        yield c


@pytest.fixture()
def fresh_cluster(tmp_path):
    """A cluster of its own, for tests that kill or restart parts of it."""
    with LocalCluster(nodes=2, devices_per_node=2, home=tmp_path / "home") as c:
        yield c


@pytest.fixture()
def client(cluster):
    with cluster.client() as c:
        yield c
