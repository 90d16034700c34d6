"""Preference pairs: text and chat records become aligned chosen/rejected rows scored on the response only, a batch
is the chosen rows then the rejected ones, and a missing column or a prompt that leaves nothing to score is a
one-line refusal."""

from __future__ import annotations

import datasets
import pytest
import torch

from automodel_ckpt.data.builtin import preference_task_dataset
from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec
from automodel_ckpt.data.pairs import PairFields, encode_pairs, pair_batches, pair_mode
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.tiny import build_tokenizer

FIELDS = PairFields()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _scored(tok, ids: torch.Tensor, labels: torch.Tensor) -> str:
    return tok.decode([i for i, label in zip(ids.tolist(), labels.tolist()) if label != IGNORE_INDEX])


def test_text_pairs_score_the_response_and_eos_and_batch_chosen_then_rejected(tok):
    ds = datasets.Dataset.from_dict({"prompt": ["12+30=", "7+8="], "chosen": ["42", "15"], "rejected": ["43", "25"]})
    data = encode_pairs(ds, tok, DataSpec(seq_length=12), FIELDS)
    batch = data.batch([1, 0])
    assert batch["input_ids"].shape == (4, 12)  # chosen 1, chosen 0, rejected 1, rejected 0
    scored = [_scored(tok, batch["input_ids"][r], batch["labels"][r]) for r in range(4)]
    assert scored == ["15</s>", "42</s>", "25</s>", "43</s>"]
    assert data.sample_ids.tolist() == [0, 1]  # pairs are named by their row


def test_chat_pairs_score_only_the_last_assistant_turn(tok):
    user = {"role": "user", "content": "1+2?"}
    ds = datasets.Dataset.from_list([{"prompt": "1+2?", "chosen": [user, {"role": "assistant", "content": "3"}],
                                      "rejected": [user, {"role": "assistant", "content": "4"}]}])
    assert pair_mode(ds, FIELDS) == "chat"
    data = encode_pairs(ds, tok, DataSpec(seq_length=64, chat_loss="last"), FIELDS)
    rows = data.batch([0])
    chosen, rejected = (_scored(tok, rows["input_ids"][r], rows["labels"][r]) for r in (0, 1))
    assert chosen.startswith("3") and rejected.startswith("4") and "1+2?" not in chosen + rejected


def test_a_missing_column_is_one_line_naming_it(tok):
    ds = datasets.Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "answer": ["c"]})
    with pytest.raises(ConfigError, match=r"missing 'rejected' \(dpo.rejected_field\); the records have answer, "
                                          r"chosen, prompt") as err:
        pair_mode(ds, FIELDS)
    assert "\n" not in str(err.value)


def test_a_prompt_that_leaves_no_token_to_score_is_refused(tok):
    ds = datasets.Dataset.from_dict({"id": [7, 8], "prompt": ["1+1=", "12345678901234+1="], "chosen": ["2", "x"],
                                     "rejected": ["3", "y"]})
    data = encode_pairs(ds, tok, DataSpec(seq_length=10), FIELDS)
    with pytest.raises(ConfigError, match="pair 8 leaves no chosen token to score in data.seq_length 10"):
        data.check_scored(10)


def test_the_builtin_pairs_reject_a_near_miss_and_validation_batches_fill_with_marked_copies(tok):
    ds = preference_task_dataset(num_samples=5, seed=3)
    for row in ds:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert int(row["chosen"]) == a + b and abs(int(row["rejected"]) - (a + b)) in (1, 10)
    data = encode_pairs(ds, tok, DataSpec(seq_length=16), FIELDS)
    ranks = [pair_batches(data, local_batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert [len(b) for b in ranks] == [2, 2]  # 3 pairs each, the second rank's last batch filled
    ids = [mb.sample_ids.tolist() for batches in ranks for mb in batches]
    assert ids == [[0, 2], [4], [1, 3], [-1]]  # the filler: a copy of pair 0 named -1, left out of every sum


def test_a_prompt_template_renders_text_pairs_prompts_from_the_records_fields(tok):
    ds = datasets.Dataset.from_dict({"a": ["12", "7"], "b": ["30", "8"], "chosen": ["42", "15"],
                                     "rejected": ["43", "25"]})
    fields = PairFields(prompt_template="{a}+{b}=")
    assert pair_mode(ds, fields) == "text"  # no prompt column needed
    data = encode_pairs(ds, tok, DataSpec(seq_length=12), fields)
    plain = encode_pairs(datasets.Dataset.from_dict({"prompt": ["12+30=", "7+8="], "chosen": ["42", "15"],
                                                     "rejected": ["43", "25"]}), tok, DataSpec(seq_length=12), FIELDS)
    for key in ("input_ids", "labels"):
        assert torch.equal(data.batch([0, 1])[key], plain.batch([0, 1])[key])
    with pytest.raises(ConfigError, match=r"record 0 has no field 'c' \(used by data.prompt_template\); its fields are: "
                                          r"a, b, chosen, rejected$"):
        encode_pairs(ds, tok, DataSpec(seq_length=12), PairFields(prompt_template="{c}"))


def test_a_prompt_template_on_chat_pairs_is_refused_in_one_line(tok):
    user = {"role": "user", "content": "1+2?"}
    ds = datasets.Dataset.from_list([{"chosen": [user, {"role": "assistant", "content": "3"}],
                                      "rejected": [user, {"role": "assistant", "content": "4"}]}])
    with pytest.raises(ConfigError, match="data.prompt_template: it renders the prompt of text pairs"):
        pair_mode(ds, PairFields(prompt_template="{x}"))


def test_the_recipe_check_takes_a_prompt_template_alone_for_pairs_and_refuses_a_completion_template():
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data.checks import check_data_section
    from tests.integration.harness import REPO

    dpo, sft = str(REPO / "recipes" / "tiny_llama_dpo.yaml"), str(REPO / "recipes" / "tiny_llama_sft.yaml")
    check_data_section(load_config(dpo, ["--data.prompt_template", "Q"], RecipeConfig))
    with pytest.raises(ConfigError, match="data.completion_template: a preference pair's responses are its "
                                          "dpo.chosen_field and dpo.rejected_field columns"):
        check_data_section(load_config(dpo, ["--data.completion_template", "answer"], RecipeConfig))
    with pytest.raises(ConfigError, match="set both data.prompt_template and data.completion_template"):
        check_data_section(load_config(sft, ["--data.prompt_template", "Q"], RecipeConfig))


def test_a_streamed_corpus_as_preference_pairs_is_refused_in_one_line(tok):
    from omegaconf import OmegaConf

    from automodel_ckpt.data.pairs import prepare_pairs

    cfg = OmegaConf.create({"dataset": {"_target_": "automodel_ckpt.data.stream.generated.builtin_text_corpus"}})
    with pytest.raises(ConfigError, match="^dataset: a streamed corpus holds no preference pairs") as refused:
        prepare_pairs(cfg, tok)
    assert "\n" not in str(refused.value)
