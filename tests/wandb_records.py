"""What an offline W&B run wrote: its ``run-ID.wandb`` files read back, for the exactness tests.

wandb-core writes each process's records to ``wandb/offline-run-TIME-ID/run-ID.wandb`` in the
LevelDB log format (32 KiB blocks of records, each with a 7-byte header, after a 7-byte file
header) holding protobuf ``Record`` messages. `logged` gathers the history rows, summary, config,
run ids and exit codes of every such file under a folder, in start order; ``_runtime`` and
``_timestamp`` are left out of the rows, as they differ between any two runs."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32768  # LevelDB log format: records in 32 KiB blocks, each with a 7-byte header
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_CLOCKS = ("_runtime", "_timestamp")  # wall-clock keys: differ between any two runs


def _records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = chunk
        elif kind == _MIDDLE:
            parts += chunk
        elif kind == _LAST:
            yield parts + chunk


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def logged(out: Path) -> dict:
    """History rows, summary, config, run ids and exit codes of every process's record under ``out``."""
    rows, summary, config, ids, exits = [], {}, {}, [], []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):  # by start time
        for raw in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({_key(i): json.loads(i.value_json) for i in record.history.item
                             if _key(i) not in _CLOCKS})
            elif kind == "summary":
                summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update
                                if not _key(u).startswith("_")})
            elif kind == "run":
                ids.append(record.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "exit":
                exits.append(record.exit.exit_code)
    return {"rows": rows, "summary": summary, "config": config, "ids": ids, "exits": exits}
