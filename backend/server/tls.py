"""TLS for a server that other machines reach: tokens travel in headers, so plain HTTP is fine
only on loopback (``serve`` warns otherwise)."""
from __future__ import annotations

import ipaddress
import ssl
from typing import Optional


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """What ``serve --tls-cert --tls-key`` serves with (TLS 1.2 or newer)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plain_http_warning(host: str, tls: bool) -> Optional[str]:
    """A warning for tokens sent in clear over the network, or None."""
    if tls or is_loopback(host):
        return None
    return (f"serving plain HTTP on {host}: tokens cross the network in clear. Serve TLS "
            f"(--tls-cert/--tls-key) or put a TLS proxy in front and firewall this port to loopback")
