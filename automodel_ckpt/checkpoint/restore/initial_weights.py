"""Starting a new run from other weights: ``restore_from`` + ``load_only`` from a checkpoint, an HF or adapter folder.

Continued training on new data starts from a trained model but not from its optimizer, schedule or data position:
``checkpoint.load_only: [model]`` loads just the named states of ``restore_from`` and leaves the rest as the recipe
built it (a fresh optimizer, step 0). ``restore_from`` may be one of this project's checkpoints (any subset of its
discovered state), a Hugging Face model folder such as a checkpoint's ``model/consolidated`` (``model`` only;
transformers maps its on-disk names to the model's) or an archive of one (``ckpt-train pack``, read in place), or a
PEFT adapter folder (``model`` only, for a LoRA run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.distributed import collective
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.ondisk.export.archive import is_archive, open_archive
from automodel_ckpt.ondisk.formats import peft as peft_format
from automodel_ckpt.checkpoint.restore.decision import ADAPTER_FOLDER, CHECKPOINT, HF_FOLDER, Decision, Source
from automodel_ckpt.checkpoint.restore.probe import probe
from automodel_ckpt.errors import CheckpointError, ConfigError


def start_from(cfg: CheckpointConfig, source: Source, states: list[str], *, model_is_peft: bool, rank: int,
               world_size: int) -> Decision:
    """Collective: check that the ``load_only`` states of ``restore_from`` can be loaded into ``states``.

    A checkpoint is fetched and probed; a Hugging Face or adapter folder is checked against the recipe's model.
    """
    only, restore_from = list(cfg.load_only or []), str(cfg.restore_from)
    unknown = [name for name in only if name not in states]
    if unknown:
        raise ConfigError(f"checkpoint.load_only: no state named {', '.join(repr(n) for n in unknown)} in this "
                          f"recipe (its state: {', '.join(sorted(states))})")
    path = source.find(restore_from, "finding checkpoint.restore_from")
    if path is None:  # an explicit restore_from is found, or ``find`` raised
        raise CheckpointError(f"checkpoint.restore_from: '{restore_from}' not found")
    kind = kind_of(path)
    if kind == CHECKPOINT:
        source.fetch(path)
        collective.collectively(
            lambda: probe(path, checksums=cfg.verify_on_load, rank=rank, world_size=world_size),
            f"checking '{path}'", rank)
    elif only != ["model"] or "model" not in states:
        raise ConfigError(f"checkpoint.load_only: a {kind} holds model weights only; use load_only: [model]")
    elif kind == ADAPTER_FOLDER and not model_is_peft:
        raise ConfigError(f"checkpoint.restore_from: '{path}' is a PEFT adapter; it needs a recipe with a "
                          "peft: section")
    elif kind == HF_FOLDER and model_is_peft:
        raise ConfigError(f"checkpoint.restore_from: '{path}' is a full model; for LoRA on top of it, set "
                          "model.pretrained_model_name_or_path to it instead")
    return Decision(path, kind, tuple(only), fresh_run=True)


def load_weights(model: Any, decision: Decision, rank: int) -> None:
    """Collective: the weights of a Hugging Face model folder or a PEFT adapter folder into ``model``."""
    folder = Path(decision.path or "")
    if decision.kind == ADAPTER_FOLDER:
        collective.collectively(lambda: peft_format.load_adapter(model, folder), f"loading '{folder}'", rank)
    else:
        load_hf_folder(model, folder, rank)


def kind_of(folder: Path) -> str:
    """``checkpoint``, ``Hugging Face model folder`` or ``adapter folder``; ``CheckpointError`` for anything else."""
    folder = Path(folder)
    if is_archive(folder):  # ``ckpt-train pack``: read in place
        with open_archive(folder) as archive:
            if layout.ADAPTER_CONFIG in archive.members:
                raise CheckpointError(f"checkpoint.restore_from: '{folder}' is an archived adapter, which is not "
                                      "read in place; unpack it (tar xf) and name the folder")
        return HF_FOLDER
    if read_metadata(folder) is not None or layout.parse_default_name(folder.name) is not None:
        return CHECKPOINT
    if (folder / layout.ADAPTER_CONFIG).exists():
        return ADAPTER_FOLDER
    if (folder / layout.HF_CONFIG).exists() and (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        return HF_FOLDER
    raise CheckpointError(f"checkpoint.restore_from: '{folder}' is neither a checkpoint, a Hugging Face model folder "
                          "(config.json + weights) nor a PEFT adapter folder")


def load_hf_folder(model: Any, folder: Path, rank: int) -> None:
    """Collective: the weights of HF folder ``folder`` into ``model`` (sharded or not).

    Each rank reads only its own slices of the folder's safetensors files (``hf_weights``: the family's on-disk
    names, tied weights and fused layouts mapped to the model's own, as transformers maps them).
    """
    from automodel_ckpt.checkpoint.restore.hf_weights import load_hf_weights

    if is_archive(folder):
        from automodel_ckpt.ondisk.export.archive_weights import ArchiveHFReader

        collective.collectively(lambda: load_hf_weights(model, folder, reader=ArchiveHFReader(folder, gap=0)),
                                f"reading '{folder}'", rank)
        return
    if not any(Path(folder).glob("*.safetensors")):  # PyTorch .bin weights only: transformers reads them
        _load_on_rank0(model, folder, rank)
        return
    collective.collectively(lambda: load_hf_weights(model, folder), f"reading '{folder}'", rank)


def _load_on_rank0(model: Any, folder: Path, rank: int) -> None:
    """Collective: the weights of HF folder ``folder`` without safetensors files, read once on rank 0.

    transformers reads the folder (its on-disk names, tied weights and fused layouts mapped to the model's own),
    and torch broadcasts each tensor from rank 0 into every rank's shards.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def read() -> dict[str, torch.Tensor]:
        from automodel_ckpt.ondisk.formats.family import auto_model_class

        dtype = next(model.parameters()).dtype
        loaded = auto_model_class(folder).from_pretrained(folder, dtype=dtype)
        wanted = set(model.state_dict())
        state = {k: v for k, v in loaded.state_dict().items() if k in wanted}
        missing = sorted(wanted - set(state))
        if missing:
            raise CheckpointError(f"'{folder}' does not fit the model: {len(missing)} tensor(s) missing "
                                  f"(e.g. '{missing[0]}')")
        return state

    full: dict[str, torch.Tensor] = {}
    collective.on_main(lambda: full.update(read()), f"reading '{folder}'", rank)  # a failure reaches every rank
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
