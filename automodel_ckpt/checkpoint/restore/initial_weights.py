"""Starting a new run from other weights: ``restore_from`` + ``load_only`` from a checkpoint, an HF or adapter folder.

Continued training on new data starts from a trained model but not from its optimizer, schedule or data position:
``checkpoint.load_only: [model]`` loads just the named states of ``restore_from`` and leaves the rest as the recipe
built it (a fresh optimizer, step 0). ``restore_from`` may be one of this project's checkpoints (any subset of its
discovered state), a Hugging Face model folder such as a checkpoint's ``model/consolidated`` (``model`` only;
transformers maps its on-disk names to the model's), or a PEFT adapter folder (``model`` only, for a LoRA run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_ckpt.checkpoint.disk import catalog, layout
from automodel_ckpt.checkpoint import collective
from automodel_ckpt.checkpoint.formats import peft as peft_format
from automodel_ckpt.checkpoint.disk.metadata import read_metadata
from automodel_ckpt.errors import CheckpointError, ConfigError


def start_from(ckpt: Any, states: dict[str, Any], restore_from: str, only: list[str]) -> Path:
    """Load the ``only`` states of ``restore_from`` into ``states`` on every rank; returns the source folder."""
    rank = ckpt.env.rank
    unknown = [name for name in only if name not in states]
    if unknown:
        raise ConfigError(f"checkpoint.load_only: no state named {', '.join(repr(n) for n in unknown)} in this "
                          f"recipe (its state: {', '.join(sorted(states))})")
    source = collective.on_main(lambda: catalog.resolve_restore_from(ckpt.dir, restore_from),
                                "finding checkpoint.restore_from", rank)
    subset = {name: states[name] for name in only}
    kind = kind_of(source)
    if kind == "checkpoint":
        from automodel_ckpt.checkpoint.restore.resume import probe

        ckpt.fetch(source)
        collective.collectively(
            lambda: probe(source, checksums=ckpt.cfg.verify_on_load, rank=rank, world_size=ckpt.env.world_size),
            f"checking '{source}'", rank)
        ckpt.load(subset, source, checked=True, fresh_run=True)
    else:
        if only != ["model"] or "model" not in states:
            raise ConfigError(f"checkpoint.load_only: a {kind} holds model weights only; use load_only: [model]")
        model = states["model"]
        if ckpt.env.is_main:
            ckpt.say(f"Loading model weights from {kind} {source}")
        if kind == "adapter folder":
            if not peft_format.is_peft_model(model):
                raise ConfigError(f"checkpoint.restore_from: '{source}' is a PEFT adapter; it needs a recipe with a "
                                  "peft: section")
            collective.collectively(lambda: peft_format.load_adapter(model, source), f"loading '{source}'", rank)
        else:
            if peft_format.is_peft_model(model):
                raise ConfigError(f"checkpoint.restore_from: '{source}' is a full model; for LoRA on top of it, set "
                                  "model.pretrained_model_name_or_path to it instead")
            load_hf_folder(model, source, rank)
    if ckpt.env.is_main:
        ckpt.say(f"Started from {', '.join(only)} of {source}; everything else starts fresh")
    return source


def kind_of(folder: Path) -> str:
    """``checkpoint``, ``Hugging Face model folder`` or ``adapter folder``; ``CheckpointError`` for anything else."""
    folder = Path(folder)
    if read_metadata(folder) is not None or layout.parse_default_name(folder.name) is not None:
        return "checkpoint"
    if (folder / layout.ADAPTER_CONFIG).exists():
        return "adapter folder"
    if (folder / layout.HF_CONFIG).exists() and (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        return "Hugging Face model folder"
    raise CheckpointError(f"checkpoint.restore_from: '{folder}' is neither a checkpoint, a Hugging Face model folder "
                          "(config.json + weights) nor a PEFT adapter folder")


def load_hf_folder(model: Any, folder: Path, rank: int) -> None:
    """Collective: the weights of HF folder ``folder`` into ``model`` (sharded or not), read once on rank 0.

    transformers reads the folder (its on-disk names, tied weights and fused layouts mapped to the model's own),
    and torch broadcasts each tensor from rank 0 into every rank's shards.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def read() -> dict[str, torch.Tensor]:
        from automodel_ckpt.checkpoint.export.family import auto_model_class

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
