"""Tiny stand-ins for real model families (built from config, saved locally) and generated data of real shapes."""

from __future__ import annotations

import json
import random
from pathlib import Path

# ChatML as Qwen2.5-Instruct uses it, default system prompt included (its tool-calling branches left out).
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_FAMILIES = {
    # family: (model_type, bos, eos, pad, extra specials, chat template)
    "llama": ("llama", "<|begin_of_text|>", "<|end_of_text|>", None, ["<|eot_id|>"], None),
    "qwen2": ("qwen2", None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>"], QWEN_CHAT_TEMPLATE),
}

WORDS = ("the a of to and in is was for on with as by at from that it an be this are which or were has had "
         "river city king war music team game water light house story school bridge forest garden").split()


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize() + "?." for _ in range(n)]


def build_family_model(family: str, folder: Path) -> Path:
    """A ~100k-parameter model of ``family`` with a byte-level BPE tokenizer trained on generated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    import torch

    model_type, bos, eos, pad, extra, template = _FAMILIES[family]
    specials = [t for t in (bos, eos, pad) if t] + extra
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                        pad_token=pad or eos, additional_special_tokens=extra)
    if template:
        tokenizer.chat_template = template
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------ data of real shapes

def _sentence(rng: random.Random, lo: int = 4, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def squad(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = _sentence(rng, 1, 3)
        context = f"{_sentence(rng)} {answer} {_sentence(rng)}"
        out.append({"id": f"q{i}", "title": "t", "context": context, "question": _sentence(rng, 3, 6) + "?",
                    "answers": {"text": [answer, answer], "answer_start": [0, 0]}})
    return out


def alpaca(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"instruction": _sentence(rng), "input": _sentence(rng) if i % 2 else "", "output": _sentence(rng)}
            for i in range(n)]


def hellaswag(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"ind": i, "activity_label": "a", "ctx": _sentence(rng), "endings": [_sentence(rng) for _ in range(4)],
             "label": str(rng.randrange(4))} for i in range(n)]


def arithmetic_chats(n: int, seed: int = 0) -> list[dict]:
    """Chats over the embedded tokenizer's alphabet: a system line, one or two user/assistant exchanges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "add."}]
        for _ in range(rng.randint(1, 2)):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            messages += [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
        out.append({"messages": messages})
    return out


def word_chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]}
            for _ in range(n)]


def texts(n: int, seed: int = 0) -> list[dict]:
    """Plain-text documents (a continued-pretraining corpus): a few sentences each."""
    rng = random.Random(seed)
    return [{"text": ". ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "."} for _ in range(n)]


def word_chat_pairs(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs as UltraFeedback has them: a prompt string, and chosen and rejected whole conversations."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        user = {"role": "user", "content": _sentence(rng)}
        pairs.append({"prompt": user["content"],
                      "chosen": [user, {"role": "assistant", "content": _sentence(rng)}],
                      "rejected": [user, {"role": "assistant", "content": _sentence(rng)}]})
    return pairs


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
