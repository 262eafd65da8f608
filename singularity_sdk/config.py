"""Where the server is and which token to use: arguments, then environment, then server.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import ConfigError

#: the environment a client (and a service the SDK starts) reads: where the service keeps its
#: files, where it answers, and the token to use
HOME_ENV = "SINGULARITY_HOME"
URL_ENV = "SINGULARITY_URL"
TOKEN_ENV = "SINGULARITY_TOKEN"
#: how jobs are sandboxed (``auto``, ``bwrap``, ``off``; backend/agent/sandbox.py)
SANDBOX_ENV = "SINGULARITY_SANDBOX"
#: a job's library modules to rewrite, comma-separated (backend/proxy/engine/libraries.py)
REWRITE_MODULES_ENV = "SINGULARITY_REWRITE_MODULES"


def default_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".singularity")


@dataclass(frozen=True)
class Connection:
    url: str
    token: str
    #: the CA certificate that signed a TLS server's certificate (server.json's "ca"), if any
    ca: Optional[str] = None


def resolve(url: Optional[str] = None, token: Optional[str] = None, home: Optional[Path] = None) -> Connection:
    """Explicit values win, then ``SINGULARITY_URL``/``SINGULARITY_TOKEN``, then
    ``$SINGULARITY_HOME/server.json`` written by ``singularityctl serve``."""
    url = url or os.environ.get(URL_ENV)
    token = token or os.environ.get(TOKEN_ENV)
    if url and token:
        return Connection(url.rstrip("/"), token)
    path = (Path(home) if home else default_home()) / "server.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"no server configured: {path} does not exist and SINGULARITY_URL/SINGULARITY_TOKEN are not set. "
            "Start one with 'singularityctl serve --nodes 2 --devices-per-node 2', or use LocalCluster()."
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return Connection((url or info["url"]).rstrip("/"), token or info["token"], info.get("ca"))
