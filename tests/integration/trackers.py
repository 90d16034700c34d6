"""Reads back what the experiment trackers stored, with the trackers' own readers (W&B: its record format)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

WANDB_BLOCK = 32768  # the .wandb file: W&B's leveldb-style log of protobuf records
WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", 0xBEE1, version
WANDB_RECORD = struct.Struct("<IHB")  # crc32, length, type (1 full, 2 first, 3 middle, 4 last)


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it (its EventAccumulator purges what a restart replaced)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tensorboard_texts(log_dir: Path) -> list[tuple[str, int, str]]:
    """(tag, step, text) of every text summary kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    out = []
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto).item()
            out.append((tag, event.step, value.decode() if isinstance(value, bytes) else str(value)))
    return out


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file, parsed with W&B's own message types."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = WANDB_HEADER.unpack_from(data)
    assert ident == b":W&B" and magic == 0xBEE1, path
    pos, pending = WANDB_HEADER.size, b""
    while pos + WANDB_RECORD.size <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < WANDB_RECORD.size:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = WANDB_RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + WANDB_RECORD.size: pos + WANDB_RECORD.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad record at {pos}"
        pos += WANDB_RECORD.size + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a ``.wandb`` file, ``{key: value}`` with ``_step``."""
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wandb_run_ids(path: Path) -> set[str]:
    return {r.run.run_id for r in wandb_records(path) if r.WhichOneof("record_type") == "run"}
