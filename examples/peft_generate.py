"""Greedy answers and held-out accuracy of a LoRA checkpoint, loaded with plain Hugging Face PEFT.

Usage: ``python examples/peft_generate.py CHECKPOINT/model [--n 100]``

The checkpoint's ``model/`` folder is a PEFT adapter folder: ``AutoPeftModelForCausalLM`` reads
``adapter_config.json``, loads the base model it names (a local folder), and applies ``adapter_model.safetensors``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

from automodel_ckpt.data import heldout_examples
from evaluation import print_accuracy_report  # examples/evaluation.py, beside this script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate a LoRA checkpoint on held-out built-in task prompts.")
    parser.add_argument("model_dir", type=Path, help="a PEFT checkpoint's model/ folder (adapter_config.json, ...)")
    parser.add_argument("--n", type=int, default=100, help="number of held-out prompts to score")
    parser.add_argument("--show", type=int, default=5, help="number of sample prompts to print")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    model = AutoPeftModelForCausalLM.from_pretrained(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model.eval()

    print_accuracy_report(model, tokenizer, heldout_examples(args.n), show=args.show,
                          max_new_tokens=args.max_new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
