"""LoRA: wrap a causal LM with Hugging Face PEFT adapters so that only the adapter weights train.

Without ``peft.target_modules``: PEFT's default for the family, else every linear layer but the head; attention only
for mixture-of-experts models (fused experts, routers left alone); an image-text model's vision tower and projector
are left out unless asked for (docs/peft.md).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from automodel_ckpt.errors import ConfigError, expect

if TYPE_CHECKING:  # keep check_peft_section importable without torch (the launcher validates recipes early)
    from torch import nn

logger = logging.getLogger(__name__)

METHODS = ("lora",)
BIAS_MODES = ("none", "all", "lora_only")
_ATTENTION_HINTS = ("attn", "attention")


def lora_config(peft: Any, model: nn.Module | None = None):
    """The ``peft.LoraConfig`` of a recipe's ``peft:`` section; targets chosen for ``model``'s family if unset."""
    from peft import LoraConfig, TaskType

    check_peft_section(peft)
    targets = list(peft.target_modules) if peft.target_modules is not None else None
    exclude = lora_exclusions(model, bool(getattr(peft, "vision_tower", False))) if model is not None else None
    if targets is None:
        if model is None:
            raise ConfigError("peft.target_modules: not set, and no model to choose the targets for")
        targets = default_targets(model)
        if not targets:
            raise ConfigError("peft.target_modules: the model has no linear layer to adapt; name the modules to adapt")
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=int(peft.rank), lora_alpha=float(peft.alpha),
                      lora_dropout=float(peft.dropout), target_modules=targets, bias=str(peft.bias),
                      use_rslora=bool(peft.use_rslora), init_lora_weights=bool(peft.init_lora_weights),
                      exclude_modules=exclude)


def check_peft_section(peft: Any) -> None:
    """One-line ``ConfigError`` for values of the ``peft:`` section that PEFT would reject later or obscurely."""
    expect(str(peft.method).lower() in METHODS, "peft.method", f"one of {', '.join(METHODS)}", peft.method)
    expect(int(peft.rank) >= 1, "peft.rank", "a positive integer", peft.rank)
    expect(0.0 <= float(peft.dropout) < 1.0, "peft.dropout", "a value in [0, 1)", peft.dropout)
    expect(str(peft.bias) in BIAS_MODES, "peft.bias", f"one of {', '.join(BIAS_MODES)}", peft.bias)
    if peft.target_modules is not None and not list(peft.target_modules):
        raise ConfigError("peft.target_modules: expected at least one module name (e.g. q_proj)")


def apply_lora(model: nn.Module, peft: Any) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` (adapters from the seeded RNG), before sharding."""
    from peft import get_peft_model

    config = lora_config(peft, model)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in config.target_modules if m not in present]
    if missing:
        raise ConfigError(
            f"peft.target_modules: no module named {', '.join(sorted(missing))} in the model "
            f"(linear layers present: {', '.join(sorted(linear_names(model)))})"
        )
    wrapped = get_peft_model(model, config)
    logger.info(lora_summary(wrapped))
    return wrapped


def adapted_modules(model: nn.Module) -> list[str]:
    """Paths of the modules a PEFT model adapts with LoRA (``...layers.0.self_attn.q_proj``)."""
    return sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A") and n)


def lora_summary(model: nn.Module) -> str:
    """One line for the run's output: the family, the target suffixes and how many modules LoRA adapts."""
    adapted = adapted_modules(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    base = getattr(model, "base_model", model)
    family = getattr(getattr(base, "config", None), "model_type", None) or "model"
    return f"LoRA: {family}, {len(adapted)} module(s) adapted ({', '.join(suffixes)} in every layer that has them)"


def default_targets(model: nn.Module) -> list[str]:
    """Module name suffixes LoRA adapts in ``model`` when the recipe names none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    config = getattr(model, "config", None)
    family = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    peft_default = [m for m in PEFT_DEFAULTS.get(family or "", []) if m in present]
    if peft_default:
        return peft_default
    return sorted(linear_names(model, attention_only="experts" in present))  # mixture-of-experts: attention only


def lora_exclusions(model: nn.Module, vision_tower: bool = False) -> str | None:
    """A PEFT ``exclude_modules`` regex for an image-text model's projector and vision tower; None for text."""
    from automodel_ckpt.model_parts import vision_module_paths

    paths = vision_module_paths(model, towers=not vision_tower)
    return "^(" + "|".join(re.escape(p) for p in paths) + r")(\..*)?$" if paths else None


def linear_names(model: nn.Module, attention_only: bool = False) -> set[str]:
    """Suffixes of the model's linear (and GPT-2 Conv1D) layers but the head; ``attention_only``: in attention."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {path.rsplit(".", 1)[-1] for path, module in model.named_modules()
            if module is not head and _is_linear(module)
            and (not attention_only or any(h in part for part in path.split(".")[:-1] for h in _ATTENTION_HINTS))}


def _is_linear(module: nn.Module) -> bool:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))
