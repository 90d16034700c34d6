"""Does GRPO's sampling give the same completions however the rows are split (the world-size guarantee) on a device?

    python tools/sampling_invariance.py [--device cpu|cuda] [--dtype float32|bfloat16] [--rows 64]
        [--max-new-tokens 16] [--json FILE]

A resume at another world size samples each completion in another batch: with 2 ranks a rank samples half the rows,
with 3 a third, in other company (other prompt lengths, so other left padding). Each completion's random stream is its
own, so the completions are the same only if the model's forward gives a row the same logits whatever batch it is
in. On this project's CPUs it does (``tests/unit/training/test_grpo.py``); on a GPU the matrix kernels may depend on
the batch's shape. This samples the same rows whole, in 2 and 3 parts and one at a time, from two random models
(a Llama of the tiny recipe's width, and a 2-layer one of Qwen2.5-0.5B's width and 151,936-token vocabulary) on
``--device`` in ``--dtype``, and reports per split how many completions differ from the whole batch's.
Exit 0 when none differs. Part of ``bash tools/gpu_checks.sh grpo``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from automodel_ckpt.training.rollout import generate, sample_seed  # noqa: E402

SHAPES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads)
    "tiny-llama": (64, 128, 256, 4, 4, 2),
    "qwen2.5-0.5b-width": (151936, 896, 4864, 2, 14, 2),
}


def model_of(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    vocab, hidden, inter, layers, heads, kv = shape
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.5)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def prompts_for(rows: int, vocab: int) -> list[list[int]]:
    """Prompts of 4 to 12 tokens (so a split changes the left padding), each row's own."""
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(3, vocab, (4 + i % 9,), generator=g).tolist() for i in range(rows)]


def parts(rows: int, n: int) -> list[range]:
    per = -(-rows // n)
    return [range(a, min(rows, a + per)) for a in range(0, rows, per)]


def check(name: str, args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    model = model_of(SHAPES[name], args.device, dtype)
    prompts = prompts_for(args.rows, SHAPES[name][0])
    seeds = [sample_seed(42, 1, i, 0) for i in range(args.rows)]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=1.0, eos_id=2, pad_id=0, device=args.device)
    whole = generate(model, prompts, seeds, **kw)
    result: dict = {"rows": args.rows, "tokens": sum(len(c) for c in whole), "differing": {}}
    for n in (2, 3, args.rows):
        split = [c for part in parts(args.rows, n)
                 for c in generate(model, [prompts[i] for i in part], [seeds[i] for i in part], **kw)]
        label = "one at a time" if n == args.rows else f"{n} parts"
        result["differing"][label] = sum(a != b for a, b in zip(whole, split))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.rows < 3 or args.max_new_tokens < 1:
        p.error("--rows must be >= 3 and --max-new-tokens >= 1")
    report = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "models": {name: check(name, args) for name in SHAPES}}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(not any(m["differing"].values()) for m in report["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
