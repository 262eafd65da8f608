"""Fixtures for the Jupyter side: one real LocalCluster for the folder, an IPython shell with the
extension loaded, and real kernels through jupyter_client."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from singularity_sdk import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def jcluster():
    """2 nodes x 2 CPU slots, shared by every test of this folder."""
    with LocalCluster(nodes=2, devices_per_node=2) as c:
        yield c


@pytest.fixture(scope="session")
def jclient(jcluster):
    with jcluster.client() as c:
        yield c


@pytest.fixture(scope="module")
def ishell(jcluster):
    """An in-process IPython shell (no kernel, so text mode unless a test turns widgets on).
    Module-scoped: the environment it sets is restored before other test folders run."""
    from IPython.testing import globalipapp

    saved = {k: os.environ.get(k) for k in ("SINGULARITY_URL", "SINGULARITY_TOKEN", "SINGULARITY_NONINTERACTIVE")}
    os.environ["SINGULARITY_URL"], os.environ["SINGULARITY_TOKEN"] = jcluster.url, jcluster.token
    os.environ.pop("SINGULARITY_NONINTERACTIVE", None)
    # The global shell is made once per process; a second module gets the same one.
    ip = globalipapp.start_ipython() or globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "jupyter_ext")
    yield ip
    ip.run_line_magic("unload_ext", "jupyter_ext")
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def shell(ishell):
    """The shell with default session settings for each test."""
    ishell.run_line_magic("singularity_config", "--reset")
    yield ishell
    ishell.run_line_magic("singularity_config", "--reset")


@pytest.fixture(scope="module")
def kernel(jcluster):
    """A real ipykernel with the extension loaded, one per test module."""
    from jupyter_helpers import Kernel, kernel_env

    k = Kernel(kernel_env(jcluster))
    reply, _ = k.execute("%load_ext jupyter_ext")
    assert reply["status"] == "ok", reply
    yield k
    k.close()
