"""A GGUF file as one side of `diff`: its tensors paired with the other model's by that model's names.

A GGUF file names its tensors as llama.cpp does (``blk.0.attn_q.weight``) and stores some in another layout. The
other side (a checkpoint, a folder, an archive, an int8 folder) is put through the GGUF export's own mapping
(``gguf_tensors.gguf_mapping``: names, the rotary permutation, Conv1D transposes, norms plus one, experts stacked per
layer), one tensor at a time, and compared with the file's tensor dequantized: in the file's layout, under the
model's name (a stacked expert tensor as one entry per expert; the tied output GPT-2 writes beside the embedding
under its GGUF name). A file's tensor the mapping does not make is listed under its GGUF name. Two GGUF files are
compared by their GGUF names. Each file tensor carries its storage type's rounding step
(``gguf_tensors.open_gguf_tensors``), so a model and its own GGUF export are ``close``.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.export.gguf_tensors import gguf_mapping, open_gguf_tensors
from automodel_ckpt.export.model_source import ModelSource

__all__ = ["gguf_alone", "gguf_beside"]

_KIND = "GGUF file"


def gguf_alone(path: Path, stack: ExitStack) -> ModelSource:
    """The GGUF file ``path`` by its own tensor names."""
    file = open_gguf_tensors(path, stack)
    out = ModelSource({}, kind=_KIND, where=str(path))
    for name, shape in file.shapes.items():
        _add(out, file, name, name, shape, lambda name=name: file.read(name))
    return out


def gguf_beside(model: ModelSource, path: Path, stack: ExitStack) -> tuple[ModelSource, ModelSource]:
    """``model`` as the GGUF export lays it out, and the GGUF file ``path``, both under the model's names."""
    file = open_gguf_tensors(path, stack)
    mapping = gguf_mapping(model.config, model.shapes)
    laid, read = ModelSource(model.config, where=model.where), ModelSource({}, kind=_KIND, where=str(path))
    last: dict[str, Any] = {}

    def whole(gguf_name: str) -> torch.Tensor:  # a stacked tensor read once for all its experts
        if last.get("name") != gguf_name:
            last.clear()
            last.update(name=gguf_name, value=file.read(gguf_name))
        return last["value"]

    made: set[str] = set()
    for t in mapping:
        if t.name not in file.shapes:  # the model's tensors the file lacks
            for source in t.sources:
                _as_saved(laid, model, source)
            continue
        made.add(t.name)
        if len(t.sources) == 1:
            name = t.sources[0] if t.sources[0] not in laid.shapes else t.name  # a tied copy: its GGUF name
            source = t.sources[0]
            laid.shapes[name], laid.dtypes[name] = t.shape, model.dtypes[source]
            laid.readers[name] = lambda t=t, s=source: t.make([model.read_saved(s)])
            if source in model.steps:  # an int8 folder's weight: its step laid out as the value is
                laid.steps[name] = lambda value, t=t, s=source: t.make([model.steps[s](value)])
                laid.formats[name] = model.formats[source]
            _add(read, file, name, t.name, file.shapes[t.name], lambda g=t.name: file.read(g))
            continue
        for e, source in enumerate(t.sources):  # experts stacked along the first dimension
            _as_saved(laid, model, source)
            _add(read, file, source, t.name, file.shapes[t.name][1:], lambda g=t.name, e=e: whole(g)[e])
    for name, shape in file.shapes.items():
        if name not in made:
            _add(read, file, name, name, shape, lambda name=name: file.read(name))
    return laid, read


def _as_saved(out: ModelSource, model: ModelSource, source: str) -> None:
    """``model``'s tensor ``source`` in ``out`` as it is saved (with its rounding step where it has one)."""
    out.shapes[source], out.dtypes[source] = model.shapes[source], model.dtypes[source]
    out.readers[source] = lambda: model.read_saved(source)
    if source in model.steps:
        out.steps[source], out.formats[source] = model.steps[source], model.formats[source]


def _add(out: ModelSource, file: Any, name: str, gguf_name: str, shape: tuple[int, ...], read: Any) -> None:
    out.shapes[name], out.dtypes[name], out.readers[name] = tuple(shape), torch.float32, read
    out.steps[name] = lambda value, g=gguf_name: file.step(g, value)
    out.formats[name] = f"GGUF {file.types[gguf_name]}"
