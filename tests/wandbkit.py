"""Reading an offline W&B run back in the tests (ZT_REPORT_TO=wandb)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024


def wandb_history(output: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The history rows and run ids of every offline W&B run under `output`, read with W&B's
    own record protobuf from its transaction log (a LevelDB-style log: 32 KiB blocks, 7-byte
    record headers; wandb 0.31 ships no Python reader of it)."""
    from wandb.proto import wandb_internal_pb2

    rows, ids = [], []
    for file in sorted(output.glob("run/wandb/wandb/offline-run-*/run-*.wandb")):
        data, pos, pending = file.read_bytes(), 7, b""  # 7: the ":W&B" file header
        while pos + 7 <= len(data):
            if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
                pos += BLOCK - pos % BLOCK
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:
                break
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in record.history.item})  # fmt: skip
                elif record.WhichOneof("record_type") == "run":
                    ids.append(record.run.run_id)
    return rows, ids
