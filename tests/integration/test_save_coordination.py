"""Save coordination at scale, checked at small scale: the one-process simulation (bench_scale.py
--simulate-ranks) plans exactly what a real gloo run plans, and a checkpoint saved with a cached plan loads on
another world size bit for bit."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_scale.py"


def _tool(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_simulation_plans_what_a_real_gloo_run_plans(tmp_path):
    """Two gloo ranks save the real-process benchmark's FSDP model twice (the second save from the cache); the
    simulation of its layout at two ranks gives the same final plan on each rank and the same metadata."""
    _tool("--ranks", "2", "--reps", "2", "--dump-plans", str(tmp_path))
    _tool("--simulate-ranks", "2", "--layout", "tiny", "--dump-plans", str(tmp_path))
    for name in ("final_2_0", "final_2_1", "metadata_2"):
        real = pickle.loads((tmp_path / f"{name}.pkl").read_bytes())  # written by this test's own runs
        simulated = pickle.loads((tmp_path / f"sim_{name}.pkl").read_bytes())
        assert simulated == real and repr(simulated) == repr(real), name  # values and types (Size, not tuple)


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _assembled(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's tensors put together from its per-rank safetensors shards, by their saved offsets."""
    pieces: dict[str, list] = {}
    for shard in sorted(model_dir.glob("shard-*.safetensors")):
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        offsets = json.loads(header.pop("__metadata__")["DCP_SHARDING_INFO"])
        for fqn, entry in header.items():
            begin, end = entry["data_offsets"]
            raw = bytearray(data[8 + n + begin:8 + n + end])
            tensor = torch.frombuffer(raw, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"]) if raw else \
                torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
            pieces.setdefault(fqn, []).append((offsets[fqn]["saved_offsets"], tensor))
    full = {}
    for fqn, parts in pieces.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        out = torch.empty(shape, dtype=parts[0][1].dtype)
        for o, t in parts:
            out[tuple(slice(a, a + s) for a, s in zip(o, t.shape))] = t
        full[fqn] = out
    return full


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_cached_plan_checkpoint_loads_on_one_rank_bit_for_bit(straight_runs):
    """The straight 2-process run saved at steps 4 and 8 with one layout: step 8 went out on the cached plan and
    write results. Its DCP metadata equals step 4's; loaded on one process (2 -> 1) through the product's load,
    the model equals its shards put together, and the optimizer equals what DCP's own reader reads."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from automodel_ckpt.ondisk.formats import registry, sharded  # the load path under test

    from tests.integration.contents import dcp_metadata

    run = straight_runs.get(2)
    four, eight = run / "epoch_0_step_4", run / "epoch_0_step_8"
    assert dcp_metadata(four / "optim" / ".metadata") == dcp_metadata(eight / "optim" / ".metadata")

    model_dir = eight / "model"
    reader = sharded._reader(model_dir, registry.get("safetensors"))
    meta = reader.read_metadata()
    model = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()}
    sharded._load(model, model_dir, reader, None, strict_keys=True)
    raw = _assembled(model_dir)
    assert sorted(raw) == sorted(model)
    for fqn, tensor in model.items():
        assert _bytes(tensor) == _bytes(raw[fqn]), fqn

    optim_dir = eight / "optim"
    meta = FileSystemReader(optim_dir).read_metadata()
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    ours = {k: torch.full(v.size, float("nan"), dtype=v.properties.dtype) for k, v in tensors.items()}
    theirs = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in tensors.items()}
    sharded._load(ours, optim_dir, sharded._reader(optim_dir, sharded.DCP_FILES), None, strict_keys=False)
    load(theirs, storage_reader=FileSystemReader(optim_dir))
    assert any(v.numel() > 1 for v in ours.values())
    for fqn in tensors:
        assert _bytes(ours[fqn]) == _bytes(theirs[fqn]), fqn
