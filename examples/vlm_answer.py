"""Answers questions about held-out images from a trained image-text model folder, loaded with plain ``transformers``.

Usage: ``python examples/vlm_answer.py MODEL_DIR [--n 120] [--show 6] [--save-images DIR]``

Held-out images of the built-in shapes task (never trained on) are asked about their colour, shape or count;
the script prints a few answers and the exact-match accuracy over ``--n`` questions.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from automodel_ckpt.data import heldout_vqa_examples


@torch.no_grad()
def answer(model: Any, processor: Any, images: Sequence[Any], conversations: Sequence[list],
           max_new_tokens: int = 8, batch_size: int = 64) -> list[str]:
    """Greedy replies of ``model`` to each ``(image, conversation)``, prompted through the processor's chat template.

    The rendered chat already holds the special tokens the template writes (``<s>``), so the tokenizer adds none:
    the model sees its prompts exactly as in training.
    """
    tokenizer = processor.tokenizer
    replies: list[str] = []
    for start in range(0, len(images), batch_size):
        texts = [processor.apply_chat_template(c, add_generation_prompt=True)
                 for c in conversations[start:start + batch_size]]
        batch = processor(images=list(images[start:start + batch_size]), text=texts, return_tensors="pt",
                          padding=True, padding_side="left", add_special_tokens=False).to(model.device)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            stop = [i for i, t in enumerate(row) if t in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
            replies.append(tokenizer.decode(row[:stop[0]] if stop else row, skip_special_tokens=True))
    return replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ask a trained image-text model about held-out shapes images.")
    parser.add_argument("model_dir", type=Path, help="Hugging Face model folder (e.g. a consolidated checkpoint)")
    parser.add_argument("--n", type=int, default=120, help="number of held-out questions to score")
    parser.add_argument("--show", type=int, default=6, help="number of answers to print")
    parser.add_argument("--save-images", type=Path, default=None, help="write the shown images here as PNG files")
    args = parser.parse_args(argv)

    processor = AutoProcessor.from_pretrained(args.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(args.model_dir)
    model.eval()
    examples = heldout_vqa_examples(args.n)
    replies = answer(model, processor, [img for img, _, _ in examples], [msgs for _, msgs, _ in examples])
    for k, ((image, messages, expected), got) in enumerate(list(zip(examples, replies))[:args.show]):
        question = messages[0]["content"][1]["text"]
        if args.save_images is not None:
            args.save_images.mkdir(parents=True, exist_ok=True)
            image.save(args.save_images / f"heldout_{k}.png")
        print(f"image {k}: {question} {got}    ({'ok' if got == expected else f'wrong, expected {expected}'})")
    kinds: dict[str, list[bool]] = {}
    for (_, messages, expected), got in zip(examples, replies):
        kinds.setdefault(messages[0]["content"][1]["text"], []).append(got == expected)
    print("by question: " + ", ".join(f"{q} {sum(v) / len(v):.2f}" for q, v in sorted(kinds.items())))
    correct = sum(got == expected for got, (_, _, expected) in zip(replies, examples))
    print(f"accuracy: {correct / len(examples):.2f} ({correct}/{len(examples)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
