"""Checks every request body and agent message passes before any model sees it.

Why here and not in the models: JSON nested thousands of levels deep makes the parser (and any
code that walks the value later: pydantic, ``json.dumps`` into the store) hit Python's recursion
limit, and a NUL byte in any string breaks ``compile``, file names and argv far from where it
came in. Both are refused once, at the edge, with a 4xx that names where the problem is.
"""
from __future__ import annotations

import json
from typing import Any

from .core import ServiceError

#: How deep objects and arrays may nest in a request or an agent message (no protocol model
#: needs more than a few levels; event data from workers stays far below this).
MAX_JSON_DEPTH = 32


def load_json_object(body: bytes | str, what: str = "the request body", nul: bool = False) -> dict[str, Any]:
    """Parse ``body`` as one JSON object within the depth limit and (unless ``nul``: a job's
    output may hold any character) without NUL bytes in any string; raise ServiceError (400
    for broken JSON, 422 naming the field) otherwise."""
    try:
        raw = json.loads(body)
    except RecursionError:
        raise ServiceError(400, f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServiceError(400, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ServiceError(400, f"{what} must be a JSON object, not {type(raw).__name__}")
    check_value(raw, what, nul)
    return raw


def check_value(value: Any, what: str = "the request body", nul: bool = False) -> None:
    """Walk ``value`` without recursion: refuse nesting past MAX_JSON_DEPTH and NUL bytes."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ServiceError(422, f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels (at '{path}')",
                               path.split(".")[0] or None)
        if isinstance(item, str):
            if "\x00" in item and not nul:
                raise ServiceError(422, f"field '{path}' holds a NUL byte; remove it", path.split(".")[0] or None)
        elif isinstance(item, dict):
            for key, sub in item.items():
                if "\x00" in key:
                    raise ServiceError(422, f"a key in '{path or 'the body'}' holds a NUL byte; remove it",
                                       path.split(".")[0] or None)
                stack.append((sub, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            for i, sub in enumerate(item):
                stack.append((sub, f"{path}.{i}" if path else str(i), depth + 1))
