"""``serve --tls-cert --tls-key``: clients and agents verify the server against its CA; plain
HTTP on that port and clients that do not trust the CA get nowhere."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from singularity_sdk import Client, JobState, LocalCluster, ServerUnreachable


@pytest.fixture()
def certificate(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_a_tls_cluster_runs_jobs_and_refuses_what_does_not_verify(tmp_path, certificate):
    cert, key = certificate
    with LocalCluster(nodes=1, devices_per_node=1, home=tmp_path / "home", tls_cert=cert, tls_key=key) as cluster:
        assert cluster.url.startswith("https://127.0.0.1:") and Path(cluster.ca) == cert.resolve()
        with cluster.client() as c:  # agents enrolled and connected over TLS, the client verified
            job = c.submit("print('over tls')")
            assert job.wait(60) == JobState.SUCCEEDED
            assert job.logs() == "over tls\n"
            assert [e.type.value for e in job.events()][-1] == "succeeded"  # the socket too (wss)
        with pytest.raises(ServerUnreachable):  # no CA: the system's trust store does not know it
            Client(cluster.url, cluster.token).jobs()
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(cluster.url.replace("https://", "http://") + "/api/v1/health",
                      headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10)
