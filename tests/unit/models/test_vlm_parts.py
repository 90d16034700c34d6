"""Image-text pieces without processes: image records encoded for training, LoRA targets, the task's split."""

from __future__ import annotations

import pytest

from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec
from automodel_ckpt.data.images import ImageChatEncoder, image_spec
from automodel_ckpt.data.shapes import heldout_vqa_examples, shapes_vqa_dataset
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.tiny_vlm import IMAGE_SIZE, NUM_IMAGE_TOKENS, build_processor, tiny_llava_config


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def test_image_record_encodes_to_expanded_image_tokens_pixels_and_answer_only_labels(processor):
    records = shapes_vqa_dataset(num_samples=3, seed=7)
    images = image_spec(processor)
    assert images.tokens_per_image == NUM_IMAGE_TOKENS and images.pixel_shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    encoder = ImageChatEncoder(processor.tokenizer, DataSpec(seq_length=64), processor, images)
    out = encoder(records[:3], [0, 1, 2])
    tok = processor.tokenizer
    for ids, labels, messages in zip(out["input_ids"], out["labels"], records["messages"]):
        assert ids.count(images.image_token_id) == NUM_IMAGE_TOKENS
        trained = [t for t, y in zip(ids, labels) if y != IGNORE_INDEX]
        assert tok.decode(trained) == messages[1]["content"][0]["text"] + tok.eos_token  # the answer and its end
    assert len(out["pixel_values"]) == 3 and out["pixel_values"][0].shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    records = records.map(lambda r: {"messages": [r["messages"][1]]})  # no image item anywhere
    with pytest.raises(ConfigError, match="expected one image token"):
        encoder(records[:1], [0])


def test_vlm_lora_adapts_the_language_model_unless_the_vision_tower_is_asked_for():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora, adapted_modules

    for vision, towers in ((False, 0), (True, 4)):
        model = LlavaForConditionalGeneration(LlavaConfig(**tiny_llava_config()))
        adapted = adapted_modules(apply_lora(model, PeftConfig(vision_tower=vision)))
        assert sum("vision_tower" in a for a in adapted) == towers
        assert sum("language_model" in a for a in adapted) == 8  # q_proj, v_proj of 4 layers
        assert not any("projector" in a for a in adapted)


def test_task_is_reproducible_and_heldout_questions_cycle():
    first, again = shapes_vqa_dataset(num_samples=20, seed=1234), shapes_vqa_dataset(num_samples=20, seed=1234)
    assert [i.tobytes() for i in first["image"]] == [i.tobytes() for i in again["image"]]
    assert first["messages"] == again["messages"]
    other = shapes_vqa_dataset(num_samples=20, seed=1234, split="heldout")
    assert [i.tobytes() for i in other["image"]] != [i.tobytes() for i in first["image"]]
    held = heldout_vqa_examples(6)
    assert [m[0]["content"][1]["text"] for _, m, _ in held[:3]] == ["what colour?", "how many?", "what shape?"]
