"""Generation accuracy for the examples: greedy decoding of prompts and exact-match scoring of the answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["answer_from_ids", "generate_answers", "generation_accuracy", "print_accuracy_report"]


def answer_from_ids(new_ids: Sequence[int], tokenizer: Any) -> str:
    """Text of generated ids up to (not including) the first end-of-sequence or padding.

    Finished rows of a batch are filled with padding after their end-of-sequence, and
    the model may keep talking past it when generation is not stopped, so everything
    from the first stop token on is discarded before decoding.
    """
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    kept: list[int] = []
    for token in new_ids:
        if int(token) in stops:
            break
        kept.append(int(token))
    return tokenizer.decode(kept, skip_special_tokens=True)


@torch.no_grad()
def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers of ``model`` to ``prompts``, one string per prompt.

    Prompts are encoded exactly as during training (the tokenizer's own special-token
    handling) and batched with **left** padding, so every row's last prompt token
    sits at the end of the input and generation continues right after it. Only the
    newly generated tokens are decoded, cut at the first end-of-sequence. The
    model's train/eval mode is restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = getattr(model, "device", torch.device("cpu"))
    was_training = bool(getattr(model, "training", False))
    if hasattr(model, "eval"):
        model.eval()
    answers: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            batch = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
            input_ids = batch["input_ids"].to(device)
            attention_mask = batch["attention_mask"].to(device)
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            new_tokens = output[:, input_ids.shape[1] :].tolist()
            answers.extend(answer_from_ids(row, tokenizer) for row in new_tokens)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return answers


def generation_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[tuple[str, str]],
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> float:
    """Fraction of ``(prompt, answer)`` examples whose greedy answer equals ``answer`` exactly.

    Exact match (no whitespace or case normalisation) is deliberate: a reply with an
    extra character before its end-of-sequence is wrong, so a high score means the
    model has learned when to stop as well as what to say. Returns 0.0 for an empty
    example list.
    """
    if not examples:
        return 0.0
    prompts = [prompt for prompt, _ in examples]
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    correct = sum(got == want for got, (_, want) in zip(answers, examples))
    return correct / len(examples)


def print_accuracy_report(
    model: Any,
    tokenizer: Any,
    examples: Sequence[tuple[str, str]],
    show: int = 5,
    max_new_tokens: int = 8,
) -> float:
    """Print the first ``show`` greedy answers with a verdict each, then ``accuracy: X (k/n)``; returns X."""
    answers = generate_answers(model, tokenizer, [prompt for prompt, _ in examples], max_new_tokens=max_new_tokens)
    for (prompt, expected), got in list(zip(examples, answers))[:show]:
        verdict = "ok" if got == expected else f"wrong, expected {expected}"
        print(f"{prompt}{got}    ({verdict})")
    correct = sum(got == expected for got, (_, expected) in zip(answers, examples))
    total = len(examples)
    accuracy = correct / total if total else 0.0
    print(f"accuracy: {accuracy:.2f} ({correct}/{total})")
    return accuracy
