"""The built-in streamed corpus: generated text in many json-lines files, written once under the datasets cache."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from automodel_ckpt.data.stream.corpus import Corpus, streamed_corpus

#: Part of the folder's name: change it when the generator's text changes for the same arguments.
GENERATED_VERSION = 1
_SPLITS = ("train", "heldout")

_SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the teacher", "our neighbor",
             "the farmer", "a small fox")
_VERBS = ("sees", "likes", "finds", "takes", "gives", "wants", "makes", "reads", "paints", "keeps")
_OBJECTS = ("a red ball", "the big book", "some fresh bread", "a small box", "the green hat", "two apples",
            "a long letter", "the blue cup", "an old map", "a warm coat")
_PLACES = ("in the park", "at home", "by the river", "on the hill", "near the school", "after dinner",
           "in the morning", "at the market")


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.3:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a}+{b}={a + b}."
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."


def _document(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 8)))


def corpus_folder(num_files: int, docs_per_file: int, seed: int, split: str) -> Path:
    """The corpus folder of these arguments, written on first use (to a temporary folder, then renamed)."""
    import datasets

    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    key = hashlib.sha256(json.dumps([GENERATED_VERSION, num_files, docs_per_file, seed, split]).encode()).hexdigest()
    root = Path(datasets.config.HF_DATASETS_CACHE) / "automodel_ckpt" / "generated"
    folder = root / f"text_corpus-{split}-{key[:16]}"
    if folder.is_dir():
        return folder
    building = root / f".building-{folder.name}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    for f in range(num_files):
        rng = random.Random(f"{split}:{seed}:{f}")
        with open(building / f"part-{f:05d}.jsonl", "w") as out:
            for _ in range(docs_per_file):
                out.write(json.dumps({"text": _document(rng)}) + "\n")
    try:
        building.rename(folder)
    except OSError:  # another process renamed its copy first: the same files
        shutil.rmtree(building, ignore_errors=True)
    return folder


def builtin_text_corpus(num_files: int = 64, docs_per_file: int = 200, seed: int = 1234, split: str = "train",
                        max_sequences: int | None = None) -> Corpus:
    """Generated sentences and additions in ``num_files`` json-lines files per ``split``, streamed like any corpus."""
    if num_files < 1 or docs_per_file < 1:
        raise ValueError("num_files and docs_per_file must be >= 1")
    folder = corpus_folder(num_files, docs_per_file, seed, split)
    return streamed_corpus(path=str(folder / "part-*.jsonl"), max_sequences=max_sequences)


builtin_text_corpus.streamed = True  # type: ignore[attr-defined]
