"""``ckpt-train import --check``: the imported model's logits against those of the source's weights.

On fixed probe token ids: the recipe's model as imported, and a copy holding the source's weights in their own dtype.
Bitwise equal for an fp32 source, else within one bf16 ulp of the larger logit.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

PROBE_ROWS, PROBE_LENGTH = 2, 16


def probe_inputs(vocab_size: int) -> torch.Tensor:
    """``PROBE_ROWS`` rows of ``PROBE_LENGTH`` token ids spread over the vocabulary (a fixed pattern)."""
    ids = (torch.arange(PROBE_ROWS * PROBE_LENGTH, dtype=torch.int64) * 7919 + 17) % max(int(vocab_size), 1)
    return ids.reshape(PROBE_ROWS, PROBE_LENGTH)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def compare(model: Any, source: dict[str, torch.Tensor]) -> str:
    """The line ``--check`` prints: ``model``'s logits against those of a copy of it holding ``source`` (our names,
    the source's dtype) on ``probe_inputs``."""
    was_training = model.training
    model.eval()
    ids = probe_inputs(model.config.vocab_size)
    ours = _logits(model, ids)
    theirs_model = copy.deepcopy(model)
    params = dict(theirs_model.named_parameters())
    with torch.no_grad():
        for name, tensor in source.items():
            params[name].copy_(tensor.to(params[name].dtype))  # bf16 values are exact in fp32
    theirs = _logits(theirs_model, ids)
    model.train(was_training)
    diff = (ours - theirs).abs().max().item()
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in source.values()})
    if torch.equal(ours, theirs):
        verdict = "bitwise equal"
    else:
        ulp = torch.finfo(torch.bfloat16).eps * theirs.abs().max().item()
        verdict = f"within one bf16 ulp ({ulp:.3g})" if diff <= ulp else f"DIFFERENT (one bf16 ulp is {ulp:.3g})"
    return (f"check: logits of the imported model and of the source's weights ({'/'.join(dtypes)}) on "
            f"{ids.shape[0]}x{ids.shape[1]} probe tokens: largest difference {diff:.3g}, {verdict}")


def check_line(run: Any, model: Any, where: str) -> str:
    """``compare`` for an imported ``run`` and the ``model`` it was put into: the source's weights as its model held
    them (``module_weights`` where it has them)."""
    from automodel_ckpt.interop import names

    held = run.module_weights or run.weights
    mapping = names.match_weights(model, list(run.weights), where, adapter=run.adapter)
    return compare(model, {ours: held[theirs] for ours, theirs in mapping.items()})
