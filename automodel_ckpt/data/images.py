"""Image + ``messages`` records to token ids, loss labels and pixel values, through the model's processor."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import datasets
import numpy as np

from automodel_ckpt.data.encode import IGNORE_INDEX, DataSpec, Encoder, token_columns
from automodel_ckpt.errors import ConfigError


@dataclass(frozen=True)
class ImageSpec:
    """What the processor does to a record's image: its image token, how many tokens one image takes, pixels."""

    image_token_id: int
    tokens_per_image: int
    pixel_shape: tuple[int, int, int]
    fingerprint: str


def image_spec(processor: Any) -> ImageSpec:
    """The :class:`ImageSpec` of a Hugging Face processor (``LlavaProcessor`` and the like)."""
    from PIL import Image

    tokenizer = processor.tokenizer
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ConfigError("model: the processor names no image token; image data needs an image-text processor")
    probe = Image.new("RGB", (8, 8))
    text = processor(text=[token], images=[probe], return_tensors="np")
    ids = list(text["input_ids"][0])
    token_id = tokenizer.convert_tokens_to_ids(token)
    pixels = tuple(text["pixel_values"].shape[1:])
    fp = hashlib.sha256((processor.image_processor.to_json_string() + str(ids)
                         + str(getattr(processor, "chat_template", None))).encode()).hexdigest()[:16]
    return ImageSpec(int(token_id), ids.count(token_id), pixels, fp)  # type: ignore[arg-type]


class ImageChatEncoder:
    """:class:`Encoder`'s chat encoding, the image token expanded to the image's tokens (no loss), and its pixels."""

    def __init__(self, tokenizer: Any, spec: DataSpec, processor: Any, images: ImageSpec) -> None:
        # The chat template: the recipe's, else the processor's (where image-text models keep theirs).
        spec = replace(spec, chat_template=spec.chat_template or getattr(processor, "chat_template", None))
        self.text = Encoder(tokenizer, spec, "chat")
        self.spec = spec
        self.processor = processor
        self.images = images

    @staticmethod
    def features(images: ImageSpec) -> datasets.Features:
        return datasets.Features({
            "input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32")),
            "sample_id": datasets.Value("int64"), "num_tokens": datasets.Value("int32"),
            "pixel_values": datasets.Array3D(images.pixel_shape, "float32"),
        })

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        field = self.spec.image_field
        ids, labels = self.text._chat(batch, indices)
        n, token, k = self.spec.seq_length, self.images.image_token_id, self.images.tokens_per_image
        out_ids, out_labels = [], []
        for record, x, y in zip(indices, ids, labels):
            if x.count(token) != 1:
                raise ConfigError(f"dataset: record {record}: expected one image token in the rendered chat, found "
                                  f"{x.count(token)} (put one {{'type': 'image'}} item in a user message)")
            at = x.index(token)
            out_ids.append(x[:at] + [token] * k + x[at + 1:])
            out_labels.append(y[:at] + [IGNORE_INDEX] * k + y[at + 1:])
        pixels = self.processor.image_processor([img.convert("RGB") for img in batch[field]],
                                                return_tensors="np")["pixel_values"]
        columns = token_columns(out_ids, out_labels, batch, indices, n)
        columns["pixel_values"] = list(np.asarray(pixels, dtype=np.float32))
        return columns
