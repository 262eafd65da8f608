"""Verifying the server's certificate when it serves TLS (``serve --tls-cert/--tls-key``).

A private CA is the usual case (the service is deployed inside an organisation): clients take
its certificate from ``ca=``, ``SINGULARITY_CA``, or the ``ca`` entry of ``server.json``; without
one, the system's trust store (or ``SSL_CERT_FILE``) decides, as for any HTTPS client.
"""
from __future__ import annotations

import os
import ssl
from typing import Any, Optional

CA_ENV = "SINGULARITY_CA"


def context(ca: Optional[str] = None) -> Optional[ssl.SSLContext]:
    """An SSL context that trusts ``ca`` (or SINGULARITY_CA); None: the defaults."""
    ca = ca or os.environ.get(CA_ENV)
    return ssl.create_default_context(cafile=ca) if ca else None


def websocket_kwargs(url: str, ctx: Optional[ssl.SSLContext]) -> dict[str, Any]:
    """``ssl=`` for websockets' connect: only for wss:// URLs (it refuses one for ws://)."""
    return {"ssl": ctx} if ctx is not None and url.startswith("wss://") else {}
