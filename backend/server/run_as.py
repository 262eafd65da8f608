"""The ``serve --run-as`` table: which OS account each user's jobs run as (backend/agent/accounts.py).

One mapping per line, ``USER ACCOUNT`` or ``USER: ACCOUNT``; blank lines and ``#`` comments are
skipped. The server reads it at start; a user missing from it cannot submit.
"""
from __future__ import annotations

import re
from pathlib import Path

#: POSIX portable user names (what useradd accepts by default)
ACCOUNT_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$")


class RunAsTableError(ValueError):
    """The table cannot be used; the message names the file, the line and what to write."""


def read_table(path: Path) -> dict[str, str]:
    """The table at ``path`` as {user: account}."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RunAsTableError(f"--run-as {path}: cannot read it ({exc.strerror})") from None
    table: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].replace(":", " ").split()
        if not line:
            continue
        if len(line) != 2 or not ACCOUNT_NAME.match(line[1]):
            raise RunAsTableError(f"--run-as {path}, line {number}: expected 'USER ACCOUNT' with an OS account "
                                  f"name such as 'alice', got {raw.strip()!r}")
        user, account = line
        if table.get(user, account) != account:
            raise RunAsTableError(f"--run-as {path}, line {number}: user {user!r} is mapped twice")
        table[user] = account
    return table
