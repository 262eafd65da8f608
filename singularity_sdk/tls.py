"""Verifying the server's certificate when it serves TLS (``serve --tls-cert/--tls-key``).

A private CA is the usual case (the service is deployed inside an organisation): clients take
its certificate from ``ca=``, ``SINGULARITY_CA``, or the ``ca`` entry of ``server.json``; without
one, the system's trust store (or ``SSL_CERT_FILE``) decides, as for any HTTPS client.
"""
from __future__ import annotations

import functools
import os
import ssl
from typing import Any, Optional

import httpx

CA_ENV = "SINGULARITY_CA"


def context(ca: Optional[str] = None) -> Optional[ssl.SSLContext]:
    """An SSL context that trusts ``ca`` (or SINGULARITY_CA); None: the defaults.

    Made once per CA file and shared (an SSLContext is meant to be): building one parses the
    certificates, and a process that opens many clients (a hundred followers) spent most of
    its time there. Without a CA, clients share httpx's default context the same way
    (`default_context`)."""
    ca = ca or os.environ.get(CA_ENV)
    return _context_for(ca) if ca else None


@functools.lru_cache(maxsize=8)
def _context_for(ca: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


def default_context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi, or SSL_CERT_FILE / SSL_CERT_DIR), made once
    per setting of those variables instead of once per client."""
    return _default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _default_context(cert_file: Optional[str], cert_dir: Optional[str]) -> ssl.SSLContext:
    return httpx.create_ssl_context()


def websocket_kwargs(url: str, ctx: Optional[ssl.SSLContext]) -> dict[str, Any]:
    """``ssl=`` for websockets' connect: only for wss:// URLs (it refuses one for ws://)."""
    return {"ssl": ctx} if ctx is not None and url.startswith("wss://") else {}
