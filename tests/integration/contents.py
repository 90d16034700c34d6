"""Compare two checkpoints by content: what must be equal when they hold the same state (e.g. sync vs async).

Three kinds of files differ between two saves of the same state, by design of the files, not of the save:
config.yaml and metadata.json (the config as run, the time), DCP's ``.metadata`` (a random save id and the
folder it was written to; its tensor metadata is compared instead), and the safetensors shards' header, whose
metadata entries come in an arbitrary order (the tensors and the parsed header are compared instead). Every
other file is compared by its checksum in manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path

DIFFER_BY_DESIGN = {"config.yaml", "metadata.json"}


def safetensors_content(path: Path) -> tuple[str, str]:
    """(canonical header JSON, sha256 of the tensor bytes) of a safetensors file."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__", {})
    if "DCP_SHARDING_INFO" in meta:  # a JSON string itself
        meta["DCP_SHARDING_INFO"] = json.loads(meta["DCP_SHARDING_INFO"])
    return json.dumps(header, sort_keys=True), hashlib.sha256(data[8 + n:]).hexdigest()


def dcp_metadata(path: Path) -> tuple:
    """The tensor metadata of a DCP ``.metadata`` file (without its save id and storage path)."""
    with open(path, "rb") as f:
        meta = pickle.load(f)  # our own test checkpoint
    return meta.state_dict_metadata, meta.storage_data, meta.planner_data


def comparable(checkpoint: Path) -> dict[str, object]:
    """``{relative path: content key}`` for every file of a checkpoint except ``DIFFER_BY_DESIGN``."""
    checkpoint = Path(checkpoint)
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    out: dict[str, object] = {}
    for rel, entry in files.items():
        if rel in DIFFER_BY_DESIGN:
            continue
        if rel.endswith(".safetensors"):
            out[rel] = safetensors_content(checkpoint / rel)
        elif rel.endswith(".metadata"):
            out[rel] = dcp_metadata(checkpoint / rel)
        else:
            out[rel] = entry["checksum"]
    return out
