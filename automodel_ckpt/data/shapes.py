"""Built-in offline image task: coloured shapes drawn with Pillow, questions about their colour, shape or count."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where rows are made: checking a recipe's dataset section needs none of it
    import datasets

#: Colour names and their RGB values.
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
                                            "yellow": (235, 210, 20)}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
MAX_COUNT: int = 3

#: Question kind -> its text (lower case: the embedded tokenizer's alphabet).
QUESTIONS: dict[str, str] = {"colour": "what colour?", "shape": "what shape?", "count": "how many?"}

_SPLITS = ("train", "heldout")


def draw(colour: str, shape: str, count: int, rng: random.Random, size: int = 32) -> Any:
    """A ``size``×``size`` RGB image, white, with ``count`` ``shape``s of ``colour``, each in its own quadrant."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    cell = size // 2  # one shape per quadrant at most, so shapes never touch and every count is visible
    for quadrant in rng.sample(range(4), count):
        side = rng.randint(cell * 9 // 16, cell - 2)
        x = (quadrant % 2) * cell + rng.randint(0, cell - side - 1)
        y = (quadrant // 2) * cell + rng.randint(0, cell - side - 1)
        box = (x, y, x + side, y + side)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def _scene(rng: random.Random) -> tuple[str, str, int, str]:
    colour = rng.choice(sorted(COLOURS))
    shape = rng.choice(SHAPES)
    count = rng.randint(1, MAX_COUNT)
    return colour, shape, count, rng.choice(sorted(QUESTIONS))


def _answer(colour: str, shape: str, count: int, question: str) -> str:
    return {"colour": colour, "shape": shape, "count": str(count)}[question]


def _messages(question: str, answer: str | None) -> list[dict[str, Any]]:
    user = {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTIONS[question]}]}
    if answer is None:
        return [user]
    return [user, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def shapes_vqa_dataset(num_samples: int = 4000, seed: int = 1234, split: str = "train",
                       image_size: int = 32) -> datasets.Dataset:
    """Columns ``id``, ``image`` and ``messages``, each image from its split's own seeded stream (disjoint splits)."""
    from automodel_ckpt.data.generated import kept_on_disk

    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    arguments = {"num_samples": num_samples, "seed": seed, "split": split, "image_size": image_size}
    return kept_on_disk("shapes_vqa", arguments, lambda: _shapes_rows(num_samples, seed, split, image_size))


def _shapes_rows(num_samples: int, seed: int, split: str, image_size: int) -> datasets.Dataset:
    import datasets

    rng = random.Random(f"shapes:{split}:{seed}")
    images, messages = [], []
    for _ in range(num_samples):
        colour, shape, count, question = _scene(rng)
        images.append(draw(colour, shape, count, rng, image_size))
        messages.append(_messages(question, _answer(colour, shape, count, question)))
    return datasets.Dataset.from_dict({"id": list(range(num_samples)), "image": images, "messages": messages},
                                      features=datasets.Features({
                                          "id": datasets.Value("int64"), "image": datasets.Image(),
                                          "messages": [{"role": datasets.Value("string"), "content": [{
                                              "type": datasets.Value("string"), "text": datasets.Value("string")}]}],
                                      }))


def heldout_vqa_examples(n: int = 120, seed: int = 4321, image_size: int = 32) -> list[tuple[Any, list, str]]:
    """``n`` held-out ``(image, messages_without_answer, answer)`` triples, questions of every kind in turn."""
    rng = random.Random(f"shapes-heldout-examples:{seed}")
    out = []
    kinds = sorted(QUESTIONS)
    for i in range(n):
        colour, shape, count, _ = _scene(rng)
        question = kinds[i % len(kinds)]
        out.append((draw(colour, shape, count, rng, image_size), _messages(question, None),
                    _answer(colour, shape, count, question)))
    return out
