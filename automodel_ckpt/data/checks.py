"""Checks of the ``data:`` keys and the dataset paths of a loaded recipe, made before any process starts."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from automodel_ckpt.config.validate import positive
from automodel_ckpt.data.chat import CHAT_LOSS_MODES
from automodel_ckpt.errors import ConfigError, expect


def check_data_section(cfg: DictConfig) -> None:
    """Raise ConfigError (one line) for a ``data:`` value that would fail later."""
    expect(cfg.data.seq_length >= 2, "data.seq_length", "at least 2", cfg.data.seq_length)
    expect(cfg.data.chat_loss in CHAT_LOSS_MODES, "data.chat_loss", f"one of {', '.join(CHAT_LOSS_MODES)}",
           cfg.data.chat_loss)
    if cfg.get("dpo") is not None and cfg.data.completion_template is not None:
        raise ConfigError("data.completion_template: a preference pair's responses are its dpo.chosen_field and "
                          "dpo.rejected_field columns; set data.prompt_template alone")
    if cfg.get("dpo") is None and (cfg.data.prompt_template is None) != (cfg.data.completion_template is None):
        missing = "prompt_template" if cfg.data.prompt_template is None else "completion_template"
        raise ConfigError(f"data.{missing}: set both data.prompt_template and data.completion_template")
    positive(cfg.data.num_proc, "data.num_proc")
    positive(cfg.data.map_batch_size, "data.map_batch_size", allow_none=False)
    positive(cfg.data.shuffle_buffer, "data.shuffle_buffer", allow_none=False)
    positive(cfg.data.max_record_bytes, "data.max_record_bytes", allow_none=False)
    for key in ("num_workers", "skip_bad_rows", "val_size"):
        expect(cfg.data[key] >= 0, f"data.{key}", ">= 0", cfg.data[key])
    from automodel_ckpt.data.stream.corpus import is_streamed

    if is_streamed(cfg.get("dataset")) and cfg.step_scheduler.max_steps is None:
        raise ConfigError("step_scheduler.max_steps: a streamed dataset has no fixed length; set max_steps")


def check_dataset_paths(cfg: DictConfig, *, fetchable: bool = False) -> list[str]:
    """A dataset path that exists nowhere is one line (with ``fetchable``, a Hub dataset to fetch is only said)."""
    from automodel_ckpt.data.files import hub_dataset_cached, is_hub_id

    lines: list[str] = []
    for section in ("dataset", "validation_dataset"):
        node = cfg.get(section)
        if node is None:
            continue
        from automodel_ckpt.checkpoint import is_url
        from automodel_ckpt.data.stream.corpus import is_streamed

        if is_streamed(node):  # globs and URLs are listed when the run starts (the listing is the corpus's identity)
            if node.get("hub") is not None:
                lines.append(f"{section}: streamed from the Hub dataset '{node.get('hub')}' (listed when the run "
                             "starts)")
                continue
            paths = [node.get("path")] if node.get("path") is not None else [s.get("path") for s in node.get("sources") or []]
            for value in paths:
                flat = [value] if isinstance(value, str) else list(value or [])
                for v in flat:
                    if isinstance(v, str) and is_url(v):
                        lines.append(f"{section}: streamed from '{v}' (listed when the run starts)")
                    elif isinstance(v, str) and not any(ch in v for ch in "*?[") and not Path(v).expanduser().exists():
                        raise ConfigError(f"{section}.path: '{v}' not found")
            continue
        for key in ("path", "data_files", "data_dir"):
            value = node.get(key)
            if isinstance(value, str) and not any(ch in value for ch in "*?[") and not Path(value).expanduser().exists():
                if key == "path" and is_hub_id(value) and hub_dataset_cached(value):
                    lines.append(f"{section}.path '{value}': cached")
                    continue
                if key == "path" and is_hub_id(value) and fetchable:
                    lines.append(f"{section}.path '{value}': not in the Hugging Face cache (datasets are read from "
                                 f"the cache only); fetch it with: hf download {value} --repo-type dataset")
                    continue
                hint = " (nor a dataset in the Hugging Face cache)" if key == "path" and is_hub_id(value) else ""
                raise ConfigError(f"{section}.{key}: '{value}' not found{hint}")
    return lines
