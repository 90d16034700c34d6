"""Data formats: record templates, chat spans, padding and packing, the tokenization cache, Hub names, preview."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from automodel_ckpt.data.chat import ChatRenderer
from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec, Encoder
from automodel_ckpt.data.fields import RecordTemplate
from automodel_ckpt.data.packing import RowBuilder
from automodel_ckpt.data.tokenize import build_rows, encode_dataset
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.tiny import build_tokenizer
from tests.integration.families import arithmetic_chats, hellaswag, squad, write_jsonl

CHAT = [{"role": "system", "content": "add."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ----------------------------------------------------------------------------------------- templates

def test_templates_read_nested_fields_and_index_by_another_field():
    record = squad(1)[0] | {"endings": ["e0", "e1", "e2"], "label": "2"}
    assert RecordTemplate("{context}|{answers.text[0]}", "k").render(record, 0) == \
        f"{record['context']}|{record['answers']['text'][0]}"
    assert RecordTemplate("{endings[label]} {endings[-1]} {{literal}}", "k").render(record, 0) == "e2 e2 {literal}"


@pytest.mark.parametrize("field", ["answers.txt[0]", "answers.text[5]", "nothere"])
def test_a_missing_field_is_one_line_naming_field_and_record(field):
    with pytest.raises(ConfigError) as err:
        RecordTemplate("{question} {" + field + "}", "data.completion_template").render(squad(1)[0], 17)
    msg = str(err.value)
    assert "\n" not in msg and f"record 17 has no field '{field}'" in msg and "data.completion_template" in msg


def test_an_unbalanced_brace_is_a_config_error():
    with pytest.raises(ConfigError, match="unbalanced brace"):
        RecordTemplate("{context", "data.prompt_template")


# ------------------------------------------------------------------------------------------------ chat

@pytest.mark.parametrize("loss, trained", [("assistant", ["3</s>", "4</s>"]), ("last", ["4</s>"])])
def test_chat_spans_cover_assistant_replies_only(tok, loss, trained):
    text, spans = ChatRenderer(tok, loss=loss).render(CHAT, 0)
    assert text == "<s>system: add. user: 1+2? assistant: 3</s>user: 2+2? assistant: 4</s>"
    assert [text[s:e] for s, e in spans] == trained


def test_chat_loss_all_trains_everything(tok):
    text, spans = ChatRenderer(tok, loss="all").render(CHAT, 0)
    assert spans == [(0, len(text))]


def test_a_tokenizer_without_chat_template_names_the_key(tok):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="tokenizer.chat_template"):
        ChatRenderer(bare)


def test_a_bad_role_is_one_line_with_the_record(tok):
    with pytest.raises(ConfigError, match="record 4: message 0 has role 'robot'"):
        ChatRenderer(tok).render([{"role": "robot", "content": "x"}], 4)


def test_chat_labels_are_exactly_the_assistant_tokens(tok):
    spec = DataSpec(seq_length=64)
    out = Encoder(tok, spec, "chat")({"messages": [CHAT]}, [0])
    ids, labels = out["input_ids"][0], out["labels"][0]
    trained = tok.decode([i for i, y in zip(ids, labels) if y != IGNORE_INDEX])
    assert trained == "3</s>4</s>"
    assert all(y in (IGNORE_INDEX, i) for i, y in zip(ids, labels))


# ------------------------------------------------------------------------------ built-in sequences

def test_prompt_completion_sequences_are_bos_prompt_completion_eos(tok):
    out = Encoder(tok, DataSpec(seq_length=16), "prompt_completion")(
        {"id": [7], "prompt": ["12+34="], "completion": ["46"]}, [0])
    chars = tok.convert_tokens_to_ids(list("12+34=46"))
    assert out["input_ids"][0] == [tok.bos_token_id, *chars, tok.eos_token_id]
    assert out["labels"][0] == [IGNORE_INDEX] * 7 + chars[-2:] + [tok.eos_token_id]
    assert out["sample_id"] == [7]


# ----------------------------------------------------------------------------------- padding, packing

def _encoded(lengths: list[int], n_total: int | None = None) -> dict[str, list]:
    ids = [[100 + 10 * k + t for t in range(n)] for k, n in enumerate(lengths)]
    return {"input_ids": ids, "labels": [list(x) for x in ids], "sample_id": list(range(len(lengths))),
            "num_tokens": [n_total or n for n in lengths]}


def test_packing_restarts_positions_and_masks_each_examples_first_token():
    rows = RowBuilder(8, packing=True, pad_id=0)(_encoded([3, 4, 5]))
    assert rows["num_examples"] == [2, 1]
    assert list(rows["position_ids"][0]) == [0, 1, 2, 0, 1, 2, 3, 0]
    assert list(rows["labels"][0][:7]) == [IGNORE_INDEX, 101, 102, IGNORE_INDEX, 111, 112, 113]
    assert list(rows["input_ids"][1]) == [120, 121, 122, 123, 124, 0, 0, 0]
    assert rows["length"] == [7, 5] and rows["sample_id"] == [0, 2]


def test_padding_keeps_one_example_per_row_and_counts_truncation():
    rows = RowBuilder(4, packing=False, pad_id=0)(_encoded([2, 4], n_total=9))
    assert [list(r) for r in rows["input_ids"]] == [[100, 101, 0, 0], [110, 111, 112, 113]]
    assert rows["num_truncated"] == [1, 1]
    assert "position_ids" not in rows


# ------------------------------------------------------------------------------------------ caching

def test_tokenization_is_cached_by_fingerprint(tmp_path, tok):
    path = write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(50))
    spec = DataSpec(seq_length=96, packing=True, cache_dir=str(tmp_path / "cache"))

    def run(s: DataSpec):
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
        encoded, info = encode_dataset(ds, tok, s)
        rows = build_rows(encoded, s, tok.pad_token_id)
        return info, rows

    first, rows1 = run(spec)
    second, rows2 = run(spec)
    assert not first.hit and second.hit and first.path == second.path and first.path.exists()
    assert rows2.caches[0].hit
    assert rows1.input_ids.equal(rows2.input_ids) and rows1.labels.equal(rows2.labels)
    other, _ = run(DataSpec(seq_length=96, packing=True, chat_loss="all", cache_dir=spec.cache_dir))
    assert not other.hit  # a setting that changes the tokens changes the fingerprint
    totals = rows1.totals()
    assert totals["examples"] == 50 and totals["rows"] < 50 and totals["truncated"] == 0


def test_truncated_examples_are_counted(tmp_path, tok):
    ds = datasets.Dataset.from_list(arithmetic_chats(20))
    spec = DataSpec(seq_length=20)
    encoded, info = encode_dataset(ds, tok, spec)
    assert info.path is None  # in memory: nothing to cache
    totals = build_rows(encoded, spec, 0).totals()
    assert totals["truncated"] == sum(n > 20 for n in encoded["num_tokens"]) > 0


# ------------------------------------------------------------------------------------------ sources

def test_a_hub_dataset_loads_from_the_local_cache(tmp_path, monkeypatch):
    """A prepared Hub dataset in the cache (as `load_dataset` leaves it) loads by name with the Hub offline."""
    from automodel_ckpt.data.files import load_local_dataset

    records = hellaswag(5)
    builder = datasets.load_dataset_builder("json", data_files={"train": str(write_jsonl(tmp_path / "t.jsonl", records))},
                                            cache_dir=str(tmp_path / "build"))
    builder.download_and_prepare()
    cache = tmp_path / "datasets"
    target = cache / "acme___hellaswag" / "default" / "0.0.0" / "0123456789abcdef"
    target.mkdir(parents=True)
    for f in Path(builder.cache_dir).iterdir():
        (target / f.name.replace("json-", "hellaswag-")).write_bytes(f.read_bytes())
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    ds = load_local_dataset("acme/hellaswag", split="train")
    assert ds["ctx"] == [r["ctx"] for r in records]
    with pytest.raises(ConfigError, match="neither a local path nor a dataset in the Hugging Face cache"):
        load_local_dataset("acme/absent")


# ------------------------------------------------------------------------------------------ preview

def test_preview_args_split_own_flags_from_overrides():
    from automodel_ckpt.cli.preview import parse_args
    from automodel_ckpt.errors import UsageError

    args = parse_args(["r.yaml", "--num", "5", "--data.seq_length", "8", "--split=validation", "--debug"])
    assert (args.recipe, args.num, args.split, args.overrides) == ("r.yaml", 5, "validation", ["--data.seq_length", "8"])
    with pytest.raises(UsageError, match="invalid choice: 'test'"):
        parse_args(["r.yaml", "--split", "test"])
    with pytest.raises(UsageError, match="unrecognized arguments: --nmu"):
        parse_args(["r.yaml", "--nmu", "5"])


# ------------------------------------------------------------------------------- packed rows in the model

def test_packed_rows_give_each_example_the_loss_it_has_alone(tok):
    """The recipe passes position_ids for packed rows: attention and positions restart at every example."""

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.data.loader import micro_batch
    from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG
    from automodel_ckpt.algorithms.context import Forward
    from automodel_ckpt.algorithms.sft.algorithm import Supervised

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA_CONFIG)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    forward = Forward(model, torch.device("cpu"), None, Supervised(None).compute_loss)  # the fine-tune's loss

    def token_loss_sum(mb) -> torch.Tensor:
        return forward.batch_loss(mb, mb.labels).loss
    from automodel_ckpt.data.builtin import chat_task_dataset

    ds = chat_task_dataset(6)
    spec = DataSpec(seq_length=64, packing=True)
    encoded, _ = encode_dataset(ds, tok, spec)
    packed = build_rows(encoded, spec, tok.pad_token_id)
    alone = build_rows(encoded, DataSpec(seq_length=64), tok.pad_token_id)
    assert len(packed) < len(alone)
    with torch.no_grad():
        together = token_loss_sum(micro_batch(packed, torch.arange(len(packed)))).item()
        separate = token_loss_sum(micro_batch(alone, torch.arange(len(alone)))).item()
        mb = micro_batch(packed, torch.arange(len(packed)))
        mb.position_ids = None  # without them the examples would see each other: a different loss
        leaky = token_loss_sum(mb).item()
    assert together == pytest.approx(separate, rel=1e-5)
    assert abs(leaky - separate) > 1e-3


TRICKY = [[{"role": "user", "content": "assistant"}, {"role": "assistant", "content": "assistant"}],
          [{"role": "user", "content": "4"}, {"role": "assistant", "content": "4"}, {"role": "tool", "content": "4"},
           {"role": "assistant", "content": "4"}],
          [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": ""}, {"role": "user", "content": "x"},
           {"role": "assistant", "content": "y"}]]


@pytest.mark.parametrize("template", ["embedded", "chatml"])
@pytest.mark.parametrize("loss", ["assistant", "last"])
def test_one_rendering_finds_the_same_spans_as_rendering_turn_by_turn(tok, template, loss):
    from tests.integration.families import QWEN_CHAT_TEMPLATE, word_chats

    fast = ChatRenderer(tok, chat_template=QWEN_CHAT_TEMPLATE if template == "chatml" else None, loss=loss)
    slow = ChatRenderer(tok, chat_template=fast.template, loss=loss)
    slow._header = slow._end_of_turn = None
    assert fast._header is not None
    for n, chat in enumerate([CHAT, *TRICKY, *(c["messages"] for c in word_chats(20))]):
        assert fast.render(chat, n) == slow.render(chat, n), chat
