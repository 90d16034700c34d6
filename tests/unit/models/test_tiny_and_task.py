"""Embedded tiny base, character tokenizer, built-in task data and generation-accuracy scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from automodel_ckpt.data.builtin import (
    addition_problems,
    arithmetic_dataset,
    builtin_task_dataset,
    heldout_examples,
    is_heldout,
)
from examples.evaluation import answer_from_ids, generate_answers, generation_accuracy, print_accuracy_report
from automodel_ckpt.models.tiny import CHARACTERS, TINY_LLAMA_CONFIG, build_tokenizer, ensure_tiny_base


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_base(tmp_path_factory.mktemp("base") / "tiny")


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_character_level_with_leading_bos() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer("12+34=").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len("12+34=")
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list("12+34=")
    assert tokenizer.eos_token_id not in ids
    assert tokenizer("12", add_special_tokens=False).input_ids == tokenizer.convert_tokens_to_ids(["1", "2"])


@pytest.mark.parametrize("text", ["12+34=46", "a b  c", CHARACTERS, ""])
def test_tokenizer_round_trip_exact(text: str) -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer(text).input_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_tokens_and_vocab() -> None:
    tokenizer = build_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert len(tokenizer) == TINY_LLAMA_CONFIG["vocab_size"] == 4 + len(CHARACTERS)
    assert tokenizer("A").input_ids[1:] == [tokenizer.unk_token_id]


def test_tokenizer_save_and_reload(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["37+45=82", "hello world"]:
        assert reloaded(text).input_ids == tokenizer(text).input_ids
        assert reloaded.decode(reloaded(text).input_ids, skip_special_tokens=True) == text
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert reloaded.pad_token_id == tokenizer.pad_token_id


# --------------------------------------------------------------------------- base model


def test_base_folder_layout_and_dtype(base_dir: Path) -> None:
    names = {p.name for p in base_dir.iterdir()}
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) == 2
    assert {"config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json"} <= names
    config = json.loads((base_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(str(base_dir / shard), framework="pt") as handle:
            assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}
    assert not [n for n in base_dir.parent.iterdir() if n.name.startswith(".")], "staging folder left behind"


def test_base_loads_offline_with_transformers(base_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 < n_params < 2_000_000
    batch = tokenizer(["1+2="], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, 5, len(tokenizer))


def test_base_is_byte_identical_and_left_untouched(base_dir: Path, tmp_path: Path) -> None:
    other = ensure_tiny_base(tmp_path / "again")
    first = {p.name: p.read_bytes() for p in base_dir.iterdir()}
    second = {p.name: p.read_bytes() for p in other.iterdir()}
    assert first == second

    marker = other / "config.json"
    before = marker.stat().st_mtime_ns
    assert ensure_tiny_base(other) == other
    assert marker.stat().st_mtime_ns == before


def test_base_refuses_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ensure_tiny_base(tmp_path / "busy")


# --------------------------------------------------------------------------- built-in task


def test_dataset_columns_and_answers() -> None:
    ds = arithmetic_dataset(num_samples=50, seed=7)
    assert ds.column_names == ["id", "prompt", "completion"]
    assert ds["id"] == list(range(50))
    for prompt, completion in zip(ds["prompt"], ds["completion"]):
        left, right = prompt.rstrip("=").split("+")
        assert prompt.endswith("=")
        assert int(completion) == int(left) + int(right)


def test_dataset_is_deterministic_and_seed_dependent() -> None:
    assert arithmetic_dataset(100, seed=3).to_dict() == arithmetic_dataset(100, seed=3).to_dict()
    assert arithmetic_dataset(100, seed=3)["prompt"] != arithmetic_dataset(100, seed=4)["prompt"]
    assert builtin_task_dataset(20, seed=3).to_dict() == arithmetic_dataset(20, seed=3).to_dict()


def test_train_and_heldout_are_disjoint() -> None:
    train, held = set(addition_problems("train")), set(addition_problems("heldout"))
    assert not train & held
    assert len(train) + len(held) == 90 * 90
    assert 500 < len(held) < 1100
    assert all(is_heldout(a, b) for a, b in held)

    train_prompts = set(arithmetic_dataset(5000, seed=1)["prompt"])
    held_prompts = set(arithmetic_dataset(500, seed=1, split="heldout")["prompt"])
    examples = heldout_examples(200)
    assert not train_prompts & held_prompts
    assert not train_prompts & {p for p, _ in examples}
    assert len({p for p, _ in examples}) == 200
    assert examples == heldout_examples(200)


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError):
        arithmetic_dataset(10, split="test")


def test_task_fits_a_short_sequence() -> None:
    tokenizer = build_tokenizer()
    ds = arithmetic_dataset(2000, seed=5)
    # bos + prompt + completion + eos
    longest = max(len(tokenizer(p + c).input_ids) + 1 for p, c in zip(ds["prompt"], ds["completion"]))
    assert longest == 11  # <s> + "ab+cd=" + three-digit sum + </s>


# --------------------------------------------------------------------------- evaluation


class _AddingModel:
    """Stands in for a causal LM whose greedy generation answers every addition correctly."""

    def __init__(self, tokenizer, wrong: set[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.wrong = wrong or set()
        self.training = True
        self.calls: list[torch.Tensor] = []

    def eval(self) -> "_AddingModel":
        self.training = False
        return self

    def train(self, mode: bool = True) -> "_AddingModel":
        self.training = mode
        return self

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        self.calls.append(attention_mask)
        tok = self.tokenizer
        rows = []
        for ids in input_ids.tolist():
            prompt = tok.decode(ids, skip_special_tokens=True)
            left, right = prompt.rstrip("=").split("+")
            answer = str(int(left) + int(right))
            if prompt in self.wrong:
                answer += "1"
            new = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
            new = (new + [tok.pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(ids + new)
        return torch.tensor(rows)


def test_generation_accuracy_perfect_and_partial() -> None:
    tokenizer = build_tokenizer()
    examples = heldout_examples(10)
    model = _AddingModel(tokenizer)
    assert generation_accuracy(model, tokenizer, examples, batch_size=4) == 1.0
    assert model.training, "train mode must be restored"
    assert len(model.calls) == 3
    assert all(mask[:, -1].all() for mask in model.calls), "prompts must be left-padded"

    wrong = {examples[0][0], examples[1][0]}
    assert generation_accuracy(_AddingModel(tokenizer, wrong), tokenizer, examples) == pytest.approx(0.8)
    assert generation_accuracy(model, tokenizer, []) == 0.0


def test_answer_is_cut_at_first_eos() -> None:
    tokenizer = build_tokenizer()
    digits = tokenizer("82", add_special_tokens=False).input_ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert answer_from_ids(digits + [eos] + digits, tokenizer) == "82"
    assert answer_from_ids(digits + [pad, pad], tokenizer) == "82"
    assert answer_from_ids(digits, tokenizer) == "82"
    assert answer_from_ids([eos], tokenizer) == ""


def test_generate_answers_with_real_model(base_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    answers = generate_answers(model, tokenizer, ["1+2=", "10+20=", "3+4="], max_new_tokens=3, batch_size=2)
    assert len(answers) == 3
    assert all(isinstance(a, str) and len(a) <= 3 for a in answers)


def test_accuracy_report_prints_samples_and_the_score(base_dir: Path, capsys) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    examples = heldout_examples(6)
    answers = generate_answers(model, tokenizer, [p for p, _ in examples], max_new_tokens=8)
    rigged = [(p, a) for (p, _), a in zip(examples[:2], answers[:2])] + examples[2:]  # the first two are right
    accuracy = print_accuracy_report(model, tokenizer, rigged, show=3)
    lines = capsys.readouterr().out.splitlines()
    right = 2 + sum(a == e for a, (_, e) in zip(answers[2:], examples[2:]))
    assert accuracy == right / 6
    assert lines[-1] == f"accuracy: {right / 6:.2f} ({right}/6)"
    assert len(lines) == 4 and lines[0].endswith("(ok)") and lines[1].endswith("(ok)")
