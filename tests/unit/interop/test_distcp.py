"""Foreign DCP folders: a Lightning distributed checkpoint read back as its .ckpt would hold it, and a folder whose
metadata runs code, claims more tensor bytes than it holds or mixes in entries of no optimizer, refused in one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from automodel_ckpt.errors import CheckpointError
from automodel_ckpt.interop import lightning, read_source
from automodel_ckpt.interop.source import Limits

LIMITS = Limits(10**6)  # the recipe's model: far more than these modules hold


class _Module(nn.Module):
    """A LightningModule's shape: the model under ``model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _lightning_folder(folder: Path, key: str = "model") -> tuple[_Module, torch.optim.AdamW]:
    """What FSDPStrategy(state_dict_type="sharded") (``key`` "model") or ModelParallelStrategy ("state_dict")
    saves after 3 steps of AdamW under CosineAnnealingLR: DCP entries and meta.pt."""
    module = _Module()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(3):
        module.model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = {key: get_model_state_dict(module), "optimizer_0": get_optimizer_state_dict(module, opt)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"epoch": 0, "global_step": 3, "lr_schedulers": [sched.state_dict()], "loops": {}},
               folder / lightning.META)
    return module, opt


@pytest.mark.parametrize("key", ["model", "state_dict"])
def test_a_lightning_folder_reads_as_its_ckpt(tmp_path, key):
    module, opt = _lightning_folder(tmp_path / "last.ckpt", key)
    run = read_source(tmp_path / "last.ckpt", LIMITS)
    assert run.step == 3 and run.kind == "Lightning distributed checkpoint (step 3)"
    assert set(run.weights) == {f"model.{n}" for n, _ in module.model.named_parameters()}
    for name, param in module.named_parameters():
        assert torch.equal(run.weights[name], param.detach())
    order = run.order(module.model)  # the recipe's model: named without the LightningModule's attribute
    assert order == [n for n, _ in module.model.named_parameters()]
    for slot, name in enumerate(order):
        assert torch.equal(run.moments[slot]["exp_avg"], opt.state[dict(module.model.named_parameters())[name]]
                           ["exp_avg"])
    assert run.groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) and run.groups[0]["count"] == 6
    assert run.schedule.target.endswith("cosine_annealing")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_folder_whose_metadata_runs_code_is_refused(tmp_path):
    folder = tmp_path / "last.ckpt"
    _lightning_folder(folder)
    marker = tmp_path / "marker"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="is not allowed in checkpoint metadata") as err:
        read_source(folder, LIMITS)
    assert "\n" not in str(err.value) and not marker.exists()


def test_a_folder_claiming_more_tensor_bytes_than_it_holds_is_refused(tmp_path):
    from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata

    folder = tmp_path / "last.ckpt"
    _lightning_folder(folder)
    metadata = load_dcp_metadata(folder / ".metadata")  # the test's own file, rewritten with one size changed
    entry = metadata.state_dict_metadata["model.model.0.weight"]
    entry.size = torch.Size([1 << 20, 1 << 12])
    entry.chunks[0].sizes = entry.size
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"claims \d+ bytes of tensors, its data files hold \d+"):
        read_source(folder, LIMITS)


def test_a_folder_with_entries_of_no_optimizer_or_no_meta_is_refused(tmp_path):
    folder = tmp_path / "last.ckpt"
    _lightning_folder(folder)
    (folder / lightning.META).unlink()
    with pytest.raises(CheckpointError, match="it has no meta.pt"):
        read_source(folder, LIMITS)
    other = tmp_path / "other.ckpt"
    module = _Module()
    dcp.save({"model": get_model_state_dict(module), "optimizer_0": {"state": {}, "param_groups": [
        {"lr": 0.1, "params": ["model.0.weight"]}]}, "extra": {"x": torch.zeros(1)}}, checkpoint_id=other,
        no_dist=True)
    torch.save({"global_step": 0}, other / lightning.META)
    with pytest.raises(CheckpointError, match="holds 'extra', which a Lightning checkpoint does not"):
        read_source(other, LIMITS)


def test_an_hf_trainer_fsdp_layout_without_its_optimizer_or_with_a_payload_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint-6"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"FSDP layout \(pytorch_model_fsdp_0/\) but it has no optimizer_0/"):
        read_source(checkpoint, LIMITS)
    _lightning_folder(tmp_path / "model")  # any DCP folder: its .metadata replaced by a payload
    marker = tmp_path / "marker"
    (tmp_path / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    from automodel_ckpt.ondisk import read_dcp_folder

    with pytest.raises(CheckpointError, match="is not allowed in checkpoint metadata"):
        read_dcp_folder(tmp_path / "model")
    assert not marker.exists()
