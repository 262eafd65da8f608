"""A node agent's own credential: read from a 0600 file or the environment, never from argv
(``/proc/PID/cmdline`` is readable by every process of the user), or enrolled once with the
join token and kept in the agent's home."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import httpx

from singularity_sdk.protocol import API_PREFIX

CREDENTIAL_FILE = "credential"
TOKEN_ENV = "SINGULARITY_AGENT_TOKEN"
JOIN_ENV = "SINGULARITY_JOIN_TOKEN"


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def save(path: Path, token: str) -> None:
    """Keep ``token`` readable by its owner only (created 0600, never readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


def enroll(server: str, node: str, join_token: str, verify: Any = True) -> str:
    """Ask the server for ``node``'s credential with the join token."""
    url = server.rstrip("/") + API_PREFIX + f"/nodes/{node}/enroll"
    try:
        r = httpx.post(url, json={}, headers={"Authorization": f"Bearer {join_token}"}, timeout=30, verify=verify)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"could not reach {server} to enroll node '{node}': {exc}") from None
    if r.status_code != 201:
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        raise RuntimeError(f"the server refused to enroll node '{node}' ({r.status_code}): {why}")
    return r.json()["token"]


def obtain(server: str, node: str, home: Path, token_file: Optional[Path] = None,
           join_token_file: Optional[Path] = None, verify: Any = True) -> str:
    """This node's credential: ``--token-file``, SINGULARITY_AGENT_TOKEN, the one kept in the
    agent's home, or a new one enrolled with the join token (then kept in the home)."""
    if token_file is not None:
        token = _read(token_file)
        if token is None:
            raise RuntimeError(f"no credential in {token_file}")
        return token
    token = os.environ.get(TOKEN_ENV) or _read(home / CREDENTIAL_FILE)
    if token:
        return token
    join = _read(join_token_file) if join_token_file else os.environ.get(JOIN_ENV)
    if not join:
        raise RuntimeError(f"no credential for node '{node}': give --token-file, or the join token (agent_token "
                           f"in the server's server.json) in {JOIN_ENV} or --join-token-file to enroll")
    token = enroll(server, node, join, verify)
    save(home / CREDENTIAL_FILE, token)
    return token
