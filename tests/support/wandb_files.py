"""Reading back what W&B writes offline: the records of a run's `.wandb` file (LevelDB's log format, W&B's header);
and the overrides of an offline W&B run, which test_wandb.py and its whole-run tests share."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768                                  # LevelDB log blocks; a record never straddles a block's 7-byte tail
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)   # W&B's file header: its magic and version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

OFFLINE = ['logging.wandb.project="nanoflow-test"', 'logging.wandb.mode="offline"', 'logging.wandb.name="study"']


def records(path: Path) -> list:
    """Every wandb_internal_pb2.Record of the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data.startswith(HEADER), path
    out, pending, offset = [], b"", len(HEADER)
    while offset + 7 <= len(data):
        if BLOCK - offset % BLOCK < 7:          # the block's tail, too short for a record header: padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        chunk, offset = data[offset + 7:offset + 7 + length], offset + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """The logged rows, each with its `_step`."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def run_record(path: Path):
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: Path) -> dict:
    """The run's config as the file sets it, key by key."""
    found = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else ()
        for u in updates:
            found[u.key] = json.loads(u.value_json)
    return found


def offline_runs(folder: Path) -> list[Path]:
    """The .wandb files of every offline run under `folder`/wandb, oldest first, once W&B has written them whole.

    run.finish() returns before W&B's service process has written the file out (seen as a file of the header alone,
    now and then, under load); W&B's own teardown - what its exit hook runs when a process ends - waits for the
    service to exit, so the files are complete after it. The next wandb.init starts a service again."""
    import wandb

    wandb.teardown()
    return sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
