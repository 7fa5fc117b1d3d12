"""Read the history of W&B offline run files (``run-<id>.wandb``) with wandb's own protobuf types.

wandb >= 0.20 ships no Python reader for these files; their framing is LevelDB's log format (32 KiB
blocks of records, each with a 7-byte header: CRC32C, little-endian length, type FULL/FIRST/
MIDDLE/LAST) after a 7-byte file header (``:W&B``, magic 0xBEE1, version 0); each record is a
``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path):
    """Every ``Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding
            pos += left_in_block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> tuple[str, list[dict]]:
    """``(run_id, [row, ...])``: each ``wandb.log`` row as ``{key: value}`` with ``_step``."""
    run_id, rows = None, []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            rows.append(row)
    return run_id, rows
