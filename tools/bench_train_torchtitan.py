"""torchtitan's own Llama 3 model trained on one GPU as its trainer does there, for tools/bench_train.py's comparison.

    python tools/bench_train_torchtitan.py --flavor 1B --seq-len 4096 --rows 2 --steps 13 [--peak-tflops 989]
        [--json OUT]

torchtitan (0.3.0) builds the model from its registry (``model_registry(flavor)``: Llama 3.2 1B's shape for ``1B``),
initialises it on the GPU (``init_states``), compiles each transformer block as its ``apply_compile`` does
(``block.compile(fullgraph=True)``) and, on one GPU (no FSDP), trains under ``torch.autocast`` to bf16 with fused
AdamW, as its trainer does with ``mixed_precision_param: bfloat16`` and a data-parallel degree of 1. Attention is
its FlexAttention (0.3.0 dropped SDPA for language models): each step passes ``positions`` and the block mask its
trainer builds from them (``get_attention_masks``), one document per row. Each step is
timed from the batch to the end of the optimizer step (the device synchronised); the report gives the median of
steps 6..N, tokens/s and the MFU both by torchtitan's FLOP count (``6 × parameters`` plus attention, its
``get_dense_model_nparams_and_flops``) and by bench_train.py's (``6 × parameters``). Never imports this package.

torchtitan 0.3.0 imports names that older torch builds lack at module level (``DataParallelMeshDims`` from
``torch.distributed.fsdp``, used only by its FSDP code, which one GPU never runs): each missing name gets an empty
placeholder class, and where that torch's ``create_block_mask`` has no ``separate_full_blocks`` argument (it
always separates full blocks, which is what torchtitan asks for) the argument is dropped. The report lists both
under ``placeholders``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import statistics
import time
from pathlib import Path


def _block_mask_without_separate_argument(placeholders: list[str]) -> None:
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    compiled = attention._compiled_create_block_mask

    def create(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("this torch's create_block_mask always separates full blocks")
        return compiled(*args, **kwargs)

    attention._compiled_create_block_mask = create
    placeholders.append("create_block_mask(separate_full_blocks=True) -> create_block_mask()")


def import_torchtitan() -> tuple[object, object, list[str]]:
    """torchtitan's model registry and FLOP count, with placeholders for the torch names this build lacks."""
    placeholders: list[str] = []
    for _ in range(20):
        try:
            from torchtitan.models.llama3 import model_registry
            from torchtitan.models.utils import get_dense_model_nparams_and_flops
            _block_mask_without_separate_argument(placeholders)
            return model_registry, get_dense_model_nparams_and_flops, placeholders
        except ImportError as exc:
            missing = re.match(r"cannot import name '(\w+)' from '(torch[\w.]*)'", str(exc))
            if not missing:
                raise
            setattr(importlib.import_module(missing.group(2)), missing.group(1), type(missing.group(1), (), {}))
            placeholders.append(f"{missing.group(2)}.{missing.group(1)}")
            for name in [m for m in sys.modules if m.startswith("torchtitan")]:
                del sys.modules[name]
    raise ImportError(f"torchtitan still fails to import after placeholders for {placeholders}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--attn", default="flex", help="torchtitan's attention backend (flex, flex_flash or varlen)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    model_registry, get_dense_model_nparams_and_flops, placeholders = import_torchtitan()

    torch.manual_seed(42)
    config = model_registry(args.flavor, attn_backend=args.attn).model
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cuda"))
    model.train()
    layer = config.layers[0]
    n_heads = layer.attention.n_heads if hasattr(layer.attention, "n_heads") else None
    params, flops_per_token = None, None
    try:
        head_dim = config.dim // n_heads
        params, flops_per_token = get_dense_model_nparams_and_flops(
            model, len(config.layers), n_heads, 2 * head_dim, args.seq_len,
            enable_weight_tying=getattr(config, "enable_weight_tying", False))
    except Exception as exc:  # noqa: BLE001 - the count is a report, not the run
        print(f"torchtitan's FLOP count failed: {exc!r}")
    params = params or sum(q.numel() for q in model.parameters())
    if args.compile:
        for block in model.layers.values():
            block.compile(backend="inductor", fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    vocab = config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (args.rows, args.seq_len + 1), device="cuda", generator=g)
        positions = torch.arange(args.seq_len, device="cuda").expand(args.rows, -1)
        masks = model.get_attention_masks(positions=positions) if args.attn != "sdpa" else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1], positions=positions, attention_masks=masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[5:] if len(times) > 5 else times[1:]
    median = statistics.median(timed)
    tokens_per_s = args.rows * args.seq_len / median
    report = {"contender": "torchtitan", "flavor": args.flavor, "seq_len": args.seq_len, "rows": args.rows,
              "compile": bool(args.compile), "attn": args.attn, "parameters": params,
              "step_seconds": times, "median_step_s": median, "tokens_per_s": tokens_per_s,
              "mfu_6n": 6 * params * tokens_per_s / (args.peak_tflops * 1e12),
              "mfu_torchtitan": (flops_per_token * tokens_per_s / (args.peak_tflops * 1e12)
                                 if flops_per_token else None),
              "flops_per_token": flops_per_token, "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(),
              "torch": torch.__version__, "placeholders": placeholders,
              "device_name": torch.cuda.get_device_name()}
    print(json.dumps({k: v for k, v in report.items() if k != "step_seconds"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
