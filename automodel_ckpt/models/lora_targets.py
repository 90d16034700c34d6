"""Which modules LoRA adapts by default, per model family.

With ``peft.target_modules`` unset the targets are chosen for the family: PEFT's own default for it where PEFT has
one (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``: ``q_proj``/``v_proj`` for Llama, ``c_attn`` for GPT-2,
...), otherwise every linear layer except the output head. Mixture-of-experts models adapt attention only by
default: their experts are fused parameters rather than linear layers, and routers are best left alone; name
expert modules in ``target_modules`` to adapt them where PEFT supports it. Image-text models take the defaults of
their language model's family; their vision tower and projector are left out unless asked for (``lora_exclusions``).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["default_targets", "linear_names", "is_moe", "lora_exclusions"]

logger = logging.getLogger(__name__)

_ATTENTION_HINTS = ("attn", "attention")


def default_targets(model: nn.Module) -> list[str]:
    """Module name suffixes LoRA adapts in ``model`` when the recipe names none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    config = getattr(model, "config", None)
    family = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    peft_default = [m for m in PEFT_DEFAULTS.get(family or "", []) if m in present]
    if peft_default:
        return peft_default
    return sorted(linear_names(model, attention_only=is_moe(model)))


def lora_exclusions(model: nn.Module, vision_tower: bool = False) -> str | None:
    """A PEFT ``exclude_modules`` regex keeping LoRA out of an image-text model's projector and, unless
    ``vision_tower``, its vision tower; None for a text model."""
    from automodel_ckpt.model_parts import vision_module_paths

    paths = vision_module_paths(model, towers=not vision_tower)
    if not paths:
        return None
    return "^(" + "|".join(re.escape(p) for p in paths) + r")(\..*)?$"


def linear_names(model: nn.Module, attention_only: bool = False) -> set[str]:
    """Suffixes of the model's linear (and GPT-2 Conv1D) layers, output head excluded.

    ``attention_only`` keeps those inside an attention block (a module path containing ``attn``/``attention``).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for path, module in model.named_modules():
        if module is head or not _is_linear(module):
            continue
        if attention_only and not any(h in part for part in path.split(".")[:-1] for h in _ATTENTION_HINTS):
            continue
        names.add(path.rsplit(".", 1)[-1])
    return names


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has mixture-of-experts layers (a module named ``experts``)."""
    return any(path.rsplit(".", 1)[-1] == "experts" for path, _ in model.named_modules())


def _is_linear(module: nn.Module) -> bool:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))
