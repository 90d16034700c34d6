"""Activation checkpointing per transformer block: each block's activations are recomputed in the backward pass.

transformers' own (non-reentrant, each block's ``forward``: FSDP2's hooks run once, names unchanged, exact resume).
"""

from __future__ import annotations

import logging

from torch import nn

from automodel_ckpt.errors import ConfigError

logger = logging.getLogger(__name__)


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of ``model`` (LoRA-wrapped or not), before ``fully_shard``; how many."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: the model inside
    if not isinstance(base, PreTrainedModel) or not base.supports_gradient_checkpointing:
        raise ConfigError(f"distributed.activation_checkpointing: {type(base).__name__} does not support activation "
                          "checkpointing; set it to false")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())
    logger.info("activation checkpointing: %d blocks", blocks)
    return blocks
