"""Static activation scales for an int8 export: the largest input each quantized projection sees on given examples.

``--calibrate N`` runs the model on the token ids ``int8_target`` makes of N examples and records the largest
absolute input of every projection the export quantizes; ``compressed-tensors`` turns that range into its
``input_scale`` (symmetric int8, one per tensor), which vLLM uses instead of a scale per token. Unlike the export,
this holds the whole model in memory, once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from automodel_ckpt.export.model_source import ModelSource, layer_count
from automodel_ckpt.errors import CheckpointError, UserError, first_line


def input_ranges(source: ModelSource, weights: list[str], examples: list[list[int]]) -> dict[str, float]:
    """``{weight name: largest |input| of its projection}`` over ``examples`` (token ids, one list per example)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not examples:
        raise UserError("--calibrate: no examples to calibrate with (the calibration data is empty)")
    layer_count(source.config, source.shapes, "int8 export")  # the layers present, before anything is built
    try:
        config = AutoConfig.from_pretrained(source.side_dir)  # the source's files, copied privately
        with torch.device("meta"):
            wanted = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"--calibrate: transformers cannot build the model of its config.json: "
                              f"{first_line(exc)}") from None
    held = sum(math.prod(shape) for shape in source.shapes.values())
    if wanted > held:  # built on the meta device first: a config asking for a larger model never allocates it
        raise CheckpointError(f"--calibrate: config.json describes a model of {wanted} parameters, the weight files "
                              f"hold {held}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # its buffers (rotary) computed here
    state = {name: source.read(name).to(torch.float32) for name in source.shapes}
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    if unexpected or any(not name.endswith("lm_head.weight") for name in missing):
        raise UserError(f"--calibrate: the model does not take the export's tensors ({(unexpected or missing)[0]})")
    ranges: dict[str, float] = {name: 0.0 for name in weights}
    hooks = [module.register_forward_pre_hook(_recorder(ranges, f"{name}.weight"))
             for name, module in model.named_modules() if f"{name}.weight" in ranges]
    model.eval()
    try:
        with torch.no_grad():
            for ids in examples:
                model(torch.tensor([ids], dtype=torch.long))
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def _recorder(ranges: dict[str, float], key: str) -> Any:
    def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        ranges[key] = max(ranges[key], float(args[0].detach().abs().max()))

    return record


def input_scale(largest: float, args: Any, dtype: torch.dtype) -> torch.Tensor:
    """The library's scale for inputs in ``[-largest, largest]`` (``args``: the scheme's input activations)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    bound = torch.tensor([max(largest, 1e-8)])
    scale, _ = calculate_qparams(-bound, bound, args)
    return scale.reshape(1).to(dtype)
