"""``ckpt-train verify --export CHECKPOINT``: the exported HF folder reloads in transformers and matches the shards.

Three checks, any failure failing the command: transformers loads ``model/consolidated/`` with no missing,
unexpected or mismatched keys; every reloaded tensor equals the shard tensor cast to its dtype, bit for bit; names,
shapes and dtypes are the base's own files' (where recorded; a cast reports its change). The reload holds the whole
model; shard tensors are read one at a time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from automodel_ckpt.ondisk import CONFIG_FILE_LIMIT, HFFolder, ModelFolder, read_header, read_json, tensor_entries
from automodel_ckpt.export.plan import resolve_model_dir
from automodel_ckpt.export.sources import open_source, read_full
from automodel_ckpt.export.hf_metadata import read_hf_metadata
from automodel_ckpt.errors import CheckpointError

_SHOWN = 5


@dataclass
class ExportReport:
    """Problems found, one line each; ``ok`` when there are none."""

    export_dir: Path
    family: str | None = None
    tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_export(checkpoint: Path) -> ExportReport:
    """Run the three checks on the export of ``checkpoint`` (a checkpoint folder, its ``model/`` folder, or the
    export itself, ``model/consolidated``)."""
    checkpoint = Path(checkpoint)
    if checkpoint.name == ModelFolder.consolidated and HFFolder(checkpoint).config.is_file():
        checkpoint = checkpoint.parent  # the export folder given: its model/ folder holds the shards to compare
    model_dir = resolve_model_dir(checkpoint)
    export_dir = ModelFolder(model_dir).consolidated.path
    if not HFFolder(export_dir).config.is_file():
        raise CheckpointError(f"no export in {export_dir}; run `ckpt-train consolidate {checkpoint}` first")
    meta = read_hf_metadata(model_dir) if ModelFolder(model_dir).hf_metadata.is_dir() else None
    report = ExportReport(export_dir, family=(meta.config or {}).get("model_type") if meta else None)
    model = _reload(export_dir, report) if _config_fits_files(export_dir, report) else None
    if model is not None:
        _compare_with_shards(model, model_dir, meta, report)
    if meta is not None and meta.original is not None:
        _compare_with_base(export_dir, meta.original, report)
    return report


_COUNT_KEY = re.compile(r"^(num|n)_(hidden_)?(layers?|experts|local_experts|routed_experts)$")


def _config_fits_files(export_dir: Path, report: ExportReport) -> bool:
    """Before a real model is built: ``config.json``'s layer and expert counts are at most the number of tensors
    in the export's files, and the model it describes, built on the meta device (nothing allocated), has at most
    as many parameters as those files hold. A config asking for a 1T-parameter model never allocates it."""
    from automodel_ckpt.ondisk import auto_model_class

    config_path = HFFolder(export_dir).config
    tensors = held = 0
    for path in sorted(export_dir.glob("*.safetensors")):
        header, _ = read_header(path)  # entries checked: shapes match their byte ranges inside the file
        for entry in tensor_entries(header).values():
            tensors, held = tensors + 1, held + math.prod(entry["shape"])
    config = read_json(config_path, "a model config", CONFIG_FILE_LIMIT)
    for key, value in _counts(config):
        if value > tensors:
            report.problems.append(f"'{config_path}': {key} is {value}, more than the {tensors} tensors in the "
                                   "export's files; not loading it")
            return False
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(export_dir))
        with torch.device("meta"):
            meta_model = auto_model_class(hf_config).from_config(hf_config)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build is the finding
        report.problems.append(f"transformers cannot build a model from '{config_path}': {str(e).splitlines()[0]}")
        return False
    wanted = sum(p.numel() for p in meta_model.parameters())
    if wanted > held:
        report.problems.append(f"'{config_path}' describes a model of {wanted} parameters, the export's files hold "
                               f"{held}; not loading it")
        return False
    return True


def _counts(value: object, prefix: str = "") -> list[tuple[str, int]]:
    """``(key, value)`` of every layer or expert count in a config, sub-configs included."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, int) and not isinstance(item, bool) and _COUNT_KEY.match(str(key)):
                found.append((prefix + str(key), item))
            elif isinstance(item, dict):
                found.extend(_counts(item, f"{prefix}{key}."))
    return found


def _reload(export_dir: Path, report: ExportReport) -> torch.nn.Module | None:
    from automodel_ckpt.ondisk import auto_model_class

    try:
        model, info = auto_model_class(export_dir).from_pretrained(export_dir, dtype="auto", output_loading_info=True,
                                                                    use_safetensors=True)
    except Exception as e:  # noqa: BLE001 - any load failure is the finding
        report.problems.append(f"transformers cannot load {export_dir}: {str(e).splitlines()[0]}")
        return None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or [])
        if keys:
            report.problems.append(f"transformers reports {len(keys)} {kind.replace('_', ' ')}: {_few(keys)}")
    return model


def _compare_with_shards(model: torch.nn.Module, model_dir: Path, meta, report: ExportReport) -> None:
    source = open_source(model_dir, meta.saved if meta else None, meta.saved_world_size if meta else None)
    state = model.state_dict()
    missing = sorted(set(source.tensors) - set(state))
    if missing:
        report.problems.append(f"{len(missing)} checkpoint tensor(s) absent from the reloaded model: {_few(missing)}")
    differ = []
    for name in sorted(set(source.tensors) & set(state)):
        loaded = state[name]
        saved = read_full(source.tensors[name])
        if tuple(saved.shape) != tuple(loaded.shape):
            differ.append(f"{name} (shape {list(loaded.shape)}, checkpoint {list(saved.shape)})")
        elif not _same_bits(saved.to(loaded.dtype), loaded):
            differ.append(f"{name} (values)")
        report.tensors += 1
    if differ:
        report.problems.append(f"{len(differ)} tensor(s) of the reloaded model differ from the checkpoint: "
                               f"{_few(differ)}")


def _compare_with_base(export_dir: Path, original: dict, report: ExportReport) -> None:
    exported: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(export_dir.glob("*.safetensors")):
        header, _ = read_header(path)
        exported.update({k: (e["dtype"], tuple(e["shape"])) for k, e in tensor_entries(header).items()})
    extra, missing = sorted(set(exported) - set(original)), sorted(set(original) - set(exported))
    if extra:
        report.problems.append(f"{len(extra)} tensor(s) the base's files do not have: {_few(extra)}")
    if missing:
        report.problems.append(f"{len(missing)} tensor(s) of the base's files missing: {_few(missing)}")
    changed = [f"{k} ({exported[k][0]} {list(exported[k][1])}, base {original[k].dtype} {list(original[k].shape)})"
               for k in sorted(set(exported) & set(original))
               if exported[k] != (original[k].dtype, tuple(original[k].shape))]
    if changed:
        report.problems.append(f"{len(changed)} tensor(s) differ in dtype or shape from the base's files: "
                               f"{_few(changed)}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _few(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")


def print_report(report: ExportReport) -> None:
    print(f"export {report.export_dir} ({report.family or 'unknown family'}, {report.tensors} tensors compared)")
    for line in report.problems:
        print(f"  FAILED: {line}")
    if report.ok:
        print("  OK: transformers loads it with no missing or unexpected keys; tensors equal the checkpoint's; "
              "names, shapes and dtypes are the base's")
