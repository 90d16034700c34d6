"""The weights-only start (``load_only``): a new run from a checkpoint's states, an HF or an adapter folder's weights.

Only the named states of ``restore_from`` load, the rest as the recipe built it; ``StartTier`` comes after the
durable tier, so a rerun of such a run resumes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from automodel_ckpt.distributed import collective
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk import layout
from automodel_ckpt.ondisk.metadata import read_metadata
from automodel_ckpt.export import is_archive, open_archive
from automodel_ckpt.ondisk.formats import peft as peft_format
from automodel_ckpt.checkpoint.storage.base import RunStorage
from automodel_ckpt.checkpoint.restore.fallback import DURABLE
from automodel_ckpt.checkpoint.restore.hf_weights import load_hf_folder
from automodel_ckpt.checkpoint.restore.loader import CheckpointLoader, Loaded
from automodel_ckpt.checkpoint.restore.probe import probe
from automodel_ckpt.errors import CheckpointError, ConfigError

CHECKPOINT = "checkpoint"
HF_FOLDER = "Hugging Face model folder"
ADAPTER_FOLDER = "adapter folder"


@dataclass(frozen=True)
class Start:
    """What a weights-only start loads: ``states`` of ``path``, a checkpoint already checked on every rank (``kind``
    ``checkpoint``), a Hugging Face model folder or a PEFT adapter folder (``model`` only)."""

    path: Path
    kind: str
    states: tuple[str, ...]


class StartTier:
    """The weights-only start, asked when the run has no checkpoint; a failure while loading stands."""

    name = DURABLE  # where the restore loaded from, as the run reports it (``restored_tier``)

    def __init__(self, cfg: CheckpointConfig, source: RunStorage, loader: CheckpointLoader, states: dict[str, Any], *,
                 rank: int, world_size: int, say: Callable[[str], None]) -> None:
        self.cfg, self.source, self.loader, self.states = cfg, source, loader, states
        self.rank, self.world_size, self.say = rank, world_size, say

    def choose(self, damage: str | None) -> Start:
        model_is_peft = "model" in self.states and peft_format.is_peft_model(self.states["model"])
        return start_from(self.cfg, self.source, sorted(self.states), model_is_peft=model_is_peft, rank=self.rank,
                          world_size=self.world_size)

    def load(self, states: dict[str, Any], start: Start) -> Loaded:
        subset = {name: states[name] for name in start.states}
        if start.kind == CHECKPOINT:
            loaded = self.loader.load(subset, start.path, checked=True, fresh_run=True)
        else:
            if self.rank == 0:
                self.say(f"Loading model weights from {start.kind} {start.path}")
            if start.kind == ADAPTER_FOLDER:
                collective.collectively(lambda: peft_format.load_adapter(subset["model"], start.path),
                                        f"loading '{start.path}'", self.rank)
            else:
                load_hf_folder(subset["model"], start.path, self.rank)
            loaded = Loaded(start.path, start.states)
        if self.rank == 0:
            self.say(f"Started from {', '.join(start.states)} of {start.path}; everything else starts fresh")
        return loaded

    def failed(self, start: Start, exc: CheckpointError) -> None:
        return None


def start_from(cfg: CheckpointConfig, source: RunStorage, states: list[str], *, model_is_peft: bool, rank: int,
               world_size: int) -> Start:
    """Collective: check that ``restore_from``'s ``load_only`` states can be loaded into ``states``."""
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
    return Start(path, kind, tuple(only))


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
