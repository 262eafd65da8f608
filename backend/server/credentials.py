"""Tokens and who they speak for.

The store keeps only a hash of each token: whoever reads ``state.db`` (a backup, a job that
escaped its sandbox) learns no credential. Tokens are 256 random bits, so one round of SHA-256
is enough (there is nothing to brute-force). Roles:

- ``admin``: everything, including creating users and enrolling nodes;
- ``user``: their own jobs;
- ``join``: only enrolling a node (``POST /api/v1/nodes/{name}/enroll``), as a Kubernetes
  bootstrap token does; ``agent_token`` in ``server.json`` is this token;
- ``node``: only the agent channel, and only as the node it was issued for (its user name
  is ``node:<name>``).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

ADMIN_ROLE = "admin"
USER_ROLE = "user"
JOIN_ROLE = "join"
NODE_ROLE = "node"
#: Homes made before credentials were per node called the join token's role "agent".
LEGACY_JOIN_ROLE = "agent"
HASH_PREFIX = "sha256:"
NODE_PREFIX = "node:"


#: Every token starts with it: a bare URL-safe token starts with ``-`` one time in 64, and
#: ``singularityctl ... --token $TOKEN`` then fails ("expected one argument"); a fixed prefix
#: also lets secret scanners recognise a leaked token.
TOKEN_PREFIX = "sg_"


def new_token() -> str:
    """A fresh credential (URL-safe, 256 random bits, after `TOKEN_PREFIX`)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What the store keeps in place of ``token``."""
    return HASH_PREFIX + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_hash(stored: str, token: str) -> bool:
    """Whether ``token`` is the one ``stored`` was made from, in constant time."""
    return hmac.compare_digest(stored.encode(), hash_token(token).encode())


def node_user(node: str) -> str:
    """The user name a node's credential is stored under."""
    return NODE_PREFIX + node


def node_of(user: str) -> str:
    """The node a node credential's user speaks for ("" for any other user)."""
    return user[len(NODE_PREFIX):] if user.startswith(NODE_PREFIX) else ""
