"""Parameter names across trainers: a source's weight names matched to the model's, and its optimizer's order.

The model here is the recipe's (wrapped or not: FSDP2, activation checkpointing and PEFT keep the Hugging Face
names). A Lightning module's names carry the attribute that holds the model (``model.``); a saved PEFT adapter's
names lack the adapter's name (``lora_A.weight`` for ``lora_A.default.weight``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from automodel_ckpt.interop.source import refuse

# the Hugging Face Trainer's parameters without weight decay (Trainer.get_decay_parameter_names)
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]
ADAPTER = "default"


def trainable(model: nn.Module) -> list[str]:
    """The trainable parameters' names in ``named_parameters`` order (a tied weight once)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def hf_trainer_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """The HF Trainer's two param groups: trainable parameters with weight decay, and those without (biases, norms)."""
    in_layernorm = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
                    for n, _ in mod.named_parameters(recurse=False)}
    names = trainable(model)
    no_decay = {n for n in names if n in in_layernorm or any(p.search(n.lower()) for p in _NO_DECAY)}
    return [n for n in names if n not in no_decay], [n for n in names if n in no_decay]


def hf_trainer_order(model: nn.Module) -> list[str]:
    """The HF Trainer's optimizer order: trainable parameters with weight decay, then those without."""
    decay, no_decay = hf_trainer_groups(model)
    return decay + no_decay


def without_adapter(name: str) -> str:
    """A name without the PEFT adapter's segment (``...lora_A.default.weight`` -> ``...lora_A.weight``)."""
    return name.replace(f".{ADAPTER}.", ".")


def match_weights(model: nn.Module, theirs: list[str], where: Any, *, adapter: bool) -> dict[str, str]:
    """``{our name: their name}`` for the weights a source holds. A full model's source must hold every parameter;
    an adapter's, every trainable one. Leftovers either way are refused by name. Their names may carry one prefix
    (a Lightning module's attribute) that ours lack."""
    ours = trainable(model) if adapter else [n for n, _ in model.named_parameters()]
    pairs, prefix = _matched(ours, theirs)
    mapping = {name: key for key, name in pairs if name is not None}
    missing = [n for n in ours if n not in mapping]
    tied = _tied_names(model)  # a tied weight saved under both names
    extra = [k for k, name in pairs if name is None and k[len(prefix):] not in tied]
    if missing:
        raise refuse(where, f"holds no weight for the model's '{missing[0]}'"
                            + (f" ({len(missing)} missing)" if len(missing) > 1 else ""))
    if extra:
        raise refuse(where, f"holds '{extra[0]}', which the recipe's model has no parameter for"
                            + (f" ({len(extra)} such)" if len(extra) > 1 else ""))
    return mapping


def slot_order(slot_names: list[str], where: Any):
    """The ``order`` of an optimizer whose slots are named (an FSDP optimizer state, consolidated): each slot's
    name mapped to the model's like the weights' names."""
    def order(model: nn.Module) -> list[str]:
        pairs, _ = _matched(trainable(model), slot_names)
        stray = next((key for key, name in pairs if name is None), None)
        if stray is not None:
            raise refuse(where, f"its optimizer holds state for '{stray}', which the recipe's model does not train")
        return [name for _, name in pairs]

    return order


def _matched(ours: list[str], theirs: list[str]) -> tuple[list[tuple[str, str | None]], str]:
    """Each of ``theirs`` with our name for it (None: none), and the one prefix theirs carry that ours lack."""
    by_plain = {without_adapter(n): n for n in ours}
    prefix = _prefix(list(by_plain), theirs)
    return [(key, by_plain.get(key[len(prefix):]) if key.startswith(prefix) else None) for key in theirs], prefix


def _prefix(ours: list[str], theirs: list[str]) -> str:
    """The one leading part of their names (``model.``, ``module.``) under which they match ours best."""
    ours_set = set(ours)
    candidates = {""}
    for key in theirs[:64]:
        parts = key.split(".")
        candidates.update(".".join(parts[:i]) + "." for i in range(1, min(len(parts), 4)))
    return max(sorted(candidates), key=lambda p: sum(1 for k in theirs if k.startswith(p) and k[len(p):] in ours_set))


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that ``named_parameters`` leaves out because another name holds the same tensor."""
    listed = {n for n, _ in model.named_parameters()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return every - listed
