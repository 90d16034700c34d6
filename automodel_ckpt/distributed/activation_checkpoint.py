"""Activation checkpointing per transformer block: each block's activations are recomputed in the backward pass.

transformers' own activation checkpointing (``activation_checkpointing_enable``, non-reentrant
``torch.utils.checkpoint``) marks every repeated block of the model, the vision tower's included. It checkpoints a
block's ``forward`` rather than its ``__call__``, so FSDP2's hooks (all-gather before the block, reshard after)
stay outside the checkpoint and run once; and it leaves the module tree as it is, so the parameter names, and with
them every checkpoint, the fingerprint and the export, are the same with and without it. A block keeps only its
input for the backward pass and recomputes the rest with the random state it ran with (dropout draws the same
numbers), so losses and gradients are those of a run without it and exact resume is unchanged. The cost is one more
forward pass per block.
"""

from __future__ import annotations

import logging

from torch import nn

from automodel_ckpt.errors import ConfigError

logger = logging.getLogger(__name__)


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of ``model`` (a transformers model, LoRA-wrapped or not); return how many.

    Call it before ``fully_shard``.
    """
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
