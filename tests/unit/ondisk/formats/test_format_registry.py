"""Model formats are plug-ins: a format defined here (one ``.npy`` file per tensor piece, per rank) and registered
runs through the whole engine: a save at one world size, a resume at another (2 real processes, FSDP2 shards),
``ckpt-train verify`` and ``ckpt-train consolidate``; and the registry's lookups of the built-in formats.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.ondisk.formats import registry
from automodel_ckpt.ondisk.formats.base import ModelFormat
from automodel_ckpt.ondisk.formats.pieces import Piece, ShardSource, SourceTensor

TOY = "npy_pieces"


def _boxes(value: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """A tensor of a model's state: its local piece, that piece's offsets in the whole tensor, the whole shape."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        return value, [0] * value.dim(), list(value.shape)
    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return value.to_local(), list(offsets), list(value.shape)


class NpyWriter:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def write_model(self, model, path, stager, written=None, threads=None):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        path.mkdir(parents=True, exist_ok=True)
        index = {}
        for i, (name, value) in enumerate(get_model_state_dict(model).items()):
            local, offsets, whole = _boxes(value)
            if local.numel() == 0 or (self.rank and offsets == [0] * len(offsets) and list(local.shape) == whole):
                continue  # an empty piece, or a whole (replicated) tensor rank 0 writes
            file = f"npy-r{self.rank}-{i:04d}.npy"
            np.save(path / file, local.detach().cpu().contiguous().numpy())
            index[name] = {"file": file, "offsets": offsets, "shape": list(local.shape), "whole": whole}
        (path / f"npy-r{self.rank}.json").write_text(json.dumps(index))
        if dist.is_initialized():
            dist.barrier()  # every rank's files are there before the save goes on
        return None  # nothing staged: written now


def _pieces(folder: Path) -> dict[str, list[tuple[Path, dict]]]:
    out: dict[str, list[tuple[Path, dict]]] = {}
    for index in sorted(folder.glob("npy-r*.json")):
        for name, entry in json.loads(index.read_text()).items():
            out.setdefault(name, []).append((folder / entry["file"], entry))
    return out


class NpyPieces(ModelFormat):
    """Each rank writes each of its tensor pieces as a ``.npy`` file, and an index of them."""

    name = TOY
    files = "npy-r*.json indexes"

    def detect(self, folder: Path) -> bool:
        return any(Path(folder).glob("npy-r*.json"))

    def writer(self, *, rank, reuse=None, hf=None) -> NpyWriter:
        return NpyWriter(rank)

    def load(self, model, folder, check=None) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        pieces = _pieces(Path(folder))
        state = get_model_state_dict(model)
        with torch.no_grad():
            for name, value in state.items():
                if name not in pieces:
                    raise CheckpointError(f"'{folder}' has no '{name}'")
                local, offsets, whole = _boxes(value)
                full = torch.empty(whole, dtype=local.dtype)
                for file, entry in pieces[name]:
                    box = tuple(slice(o, o + s) for o, s in zip(entry["offsets"], entry["shape"]))
                    full[box] = torch.from_numpy(np.load(file))
                local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))])
        set_model_state_dict(model, state)

    def open_source(self, folder, saved_world_size=None) -> ShardSource:
        tensors, files = {}, []
        for name, found in _pieces(Path(folder)).items():
            tensor = tensors[name] = SourceTensor(name, tuple(found[0][1]["whole"]), torch.float32)
            for file, entry in found:
                with open(file, "rb") as f:
                    np.lib.format.read_array_header_1_0(f) if np.lib.format.read_magic(f) == (1, 0) else \
                        np.lib.format.read_array_header_2_0(f)
                    start = f.tell()
                length = file.stat().st_size - start
                tensor.pieces.append(Piece(file, tuple(entry["offsets"]), tuple(entry["shape"]), start, length))
                files.append(file)
        return ShardSource(Path(folder), TOY, tensors, sorted(files))


@pytest.fixture
def toy():
    fmt = registry.register(NpyPieces())
    yield fmt
    registry.unregister(TOY)


class Toy:
    """A model, its AdamW and a counter: what a recipe checkpoints."""

    def __init__(self, seed: int = 0) -> None:
        from tests.unit.checkpoint.ckpt_state import Counter

        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 2))
        self.optimizer = None
        self.counter = Counter()

    def shard(self, world_size: int) -> Toy:
        if world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for layer in self.model:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        return self

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model(torch.randn(3, 4, generator=g)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.counter.n += 1

    def states(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "counter": self.counter}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer state tensor, whole."""
        def whole(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else torch.as_tensor(t)).detach().clone()

        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {f"p.{n}": whole(p) for n, p in self.model.named_parameters()}
        for p, st in self.optimizer.state.items():
            out |= {f"o.{names[id(p)]}.{k}": whole(v) for k, v in st.items()}
        return out


def _checkpointer(env, root: Path):
    from automodel_ckpt.checkpoint.checkpointer import Checkpointer
    from automodel_ckpt.checkpoint.config import CheckpointConfig

    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=TOY, save_consolidated="false")
    assert cfg.model_save_format == TOY
    return Checkpointer(cfg, env, resolved_config_yaml=f"checkpoint: {{model_save_format: {TOY}}}\n",
                        say=lambda _msg: None)


def _info(step: int):
    from automodel_ckpt.ondisk.info import SaveInfo

    return SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _two_ranks(rank: int, root: str, port: int) -> None:
    """Rank ``rank`` of 2: resume the 1-rank checkpoint (FSDP2 shards), check it bit for bit, step, save."""
    import torch.distributed as dist

    from automodel_ckpt.distributed.env import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        registry.register(NpyPieces())
        env = init_distributed()
        ckpt = _checkpointer(env, Path(root) / "run")
        state = Toy(seed=99).shard(2)
        state.step(seed=99)  # moments to load into, other values than the checkpoint's
        restored = ckpt.resume(state.states())
        result = {"resumed": str(restored.path), "counter": state.counter.n, "loaded": state.tensors()}
        state.step(seed=2)
        ckpt.save(state.states(), _info(2))
        ckpt.finalize()
        result["saved"] = state.tensors()
        if rank == 0:
            torch.save(result, Path(root) / "two_ranks.pt")
    finally:
        dist.destroy_process_group()


def test_a_registered_format_saves_resumes_at_another_world_size_verifies_and_exports(toy, tmp_path, capsys):
    from safetensors.torch import load_file

    from automodel_ckpt.cli import main
    from automodel_ckpt.distributed.env import init_distributed
    from automodel_ckpt.ondisk import layout

    env = init_distributed()
    ckpt = _checkpointer(env, tmp_path / "run")
    state = Toy().shard(1)
    state.step(seed=1)
    first = ckpt.save(state.states(), _info(1))
    ckpt.finalize()
    saved = state.tensors()
    model_dir = first / layout.MODEL_DIR
    assert registry.detect(model_dir) is toy and sorted(p.name for p in model_dir.glob("npy-*.json")) == [
        "npy-r0.json"]
    assert json.loads((first / layout.METADATA_FILE).read_text())["model_save_format"] == TOY

    with socket.socket() as s:  # the resume at world size 2, and its save
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_ranks, args=(str(tmp_path), port), nprocs=2, start_method="spawn")
    two = torch.load(tmp_path / "two_ranks.pt")
    assert two["resumed"] == str(first) and two["counter"] == 1
    assert _same(two["loaded"], saved)  # bit for bit, resharded over 2 ranks
    second = tmp_path / "run" / "epoch_0_step_2"
    assert sorted(p.name for p in (second / layout.MODEL_DIR).glob("npy-*.json")) == ["npy-r0.json", "npy-r1.json"]

    back = Toy(seed=7).shard(1)  # and back to 1 rank
    _checkpointer(env, tmp_path / "run").load(back.states(), second)
    assert _same(back.tensors(), two["saved"]) and back.counter.n == 2

    assert main(["verify", str(second)]) == 0
    assert main(["consolidate", str(second)]) == 0
    capsys.readouterr()
    exported = {}
    for file in sorted((second / layout.MODEL_DIR / layout.CONSOLIDATED_DIR).glob("*.safetensors")):
        exported |= load_file(str(file))
    assert _same({f"p.{k}": v for k, v in exported.items()}, {k: v for k, v in two["saved"].items() if k[0] == "p"})


def test_the_registry_detects_each_built_in_format_and_refuses_an_unknown_name(tmp_path):
    from automodel_ckpt.checkpoint.config import CheckpointConfig
    from automodel_ckpt.ondisk import layout

    assert registry.names() == ["safetensors", "torch_save"]
    assert registry.names(configurable=False) == ["adapter", "safetensors", "torch_save"]
    assert registry.detect(tmp_path / "absent") is None and registry.detect(tmp_path) is None
    (tmp_path / layout.DCP_METADATA).write_bytes(b"")
    assert registry.detect(tmp_path).name == "torch_save"
    (tmp_path / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"")
    assert registry.detect(tmp_path).name == "safetensors"
    (tmp_path / layout.ADAPTER_CONFIG).write_text("{}")
    assert registry.detect(tmp_path).name == "adapter"  # before safetensors: its weights are a .safetensors file
    with pytest.raises(ConfigError, match="expected one of safetensors, torch_save, got 'npy'"):
        CheckpointConfig(model_save_format="npy")
    with pytest.raises(ConfigError):
        registry.get("adapter-ish")


def test_a_registered_format_is_a_value_of_model_save_format_until_it_is_removed(toy):
    from automodel_ckpt.checkpoint.config import CheckpointConfig

    assert TOY in registry.names() and CheckpointConfig(model_save_format=TOY.upper()).model_save_format == TOY
    registry.unregister(TOY)
    with pytest.raises(ConfigError):
        CheckpointConfig(model_save_format=TOY)
