"""Activation checkpointing recomputes every block (text, vision, LoRA-wrapped) in backward, leaves parameter names
as they are, and gives the same gradients as a run without it."""

from __future__ import annotations

import pytest
import torch

from automodel_ckpt.config.schema import PeftConfig
from automodel_ckpt.distributed.activation_checkpoint import checkpoint_blocks
from automodel_ckpt.distributed.fsdp import decoder_layers
from automodel_ckpt.models.build import build_causal_lm, build_image_text_model
from automodel_ckpt.models.lora import apply_lora
from automodel_ckpt.model_parts import vision_tower
from automodel_ckpt.models.tiny_vlm import IMAGE_SIZE, NUM_IMAGE_TOKENS, tiny_llava_config

LLAMA = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}


def _model(kind: str) -> torch.nn.Module:
    if kind == "vlm":
        return build_image_text_model(config={"model_type": "llava", **tiny_llava_config()}, seed=3)
    model = build_causal_lm(config=LLAMA, seed=3)
    return apply_lora(model, PeftConfig(init_lora_weights=False)) if kind == "lora" else model


def _step(model: torch.nn.Module, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    ids = torch.arange(12).remainder(20).view(2, 6) + 1
    if kind == "vlm":
        image = torch.full((2, NUM_IMAGE_TOKENS), model.config.image_token_id)
        ids = torch.cat([ids[:, :1], image, ids[:, 1:]], dim=1)
        pixels = torch.linspace(-1, 1, 2 * 3 * IMAGE_SIZE * IMAGE_SIZE).view(2, 3, IMAGE_SIZE, IMAGE_SIZE)
        loss = model(input_ids=ids, pixel_values=pixels, labels=ids).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "lora", "vlm"])
def test_every_block_is_recomputed_in_backward_with_the_same_gradients(kind):
    plain, checkpointed = _model(kind), _model(kind)
    names = [n for n, _ in checkpointed.named_parameters()]
    tower = vision_tower(checkpointed)
    blocks = decoder_layers(checkpointed, exclude=tower) + (decoder_layers(tower) if tower is not None else [])
    assert checkpoint_blocks(checkpointed) == len(blocks) > 0
    assert [n for n, _ in checkpointed.named_parameters()] == names  # checkpoints and exports see the same names
    calls = []
    for block in blocks:  # a submodule inside the block: called again when backward recomputes the block
        inner = next(m for m in block.children() if any(True for _ in m.parameters()))
        inner.register_forward_hook(lambda *_: calls.append(1))
    loss_plain, grads_plain = _step(plain, kind)
    loss_ckpt, grads_ckpt = _step(checkpointed, kind)
    assert len(calls) == 2 * len(blocks)  # forward, then the recompute in backward
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys() and grads_plain
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)


def test_a_model_without_blocks_to_checkpoint_is_a_one_line_error():
    from automodel_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="distributed.activation_checkpointing: Linear does not support"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
