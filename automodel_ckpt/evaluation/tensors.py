"""One model's tensors, read one at a time: a checkpoint (any world size and format), an export or int8 folder, an archive, an adapter.

A full model comes from ``export.open_model`` in the dtypes its Hugging Face export gives them (``read_saved``: as
saved); an int8 folder's weights dequantized, each with its rounding step; a LoRA adapter folder as its adapter
tensors, so averaging adapters gives an adapter. Nothing read here runs a pickle or instantiates a config.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from automodel_ckpt.errors import CheckpointError, UserError
from automodel_ckpt.export import ModelSource, dequantize_int8, is_int8, open_model
from automodel_ckpt.ondisk import (INDEX_FILE_LIMIT, SMALL_FILE_LIMIT, ST_TO_TORCH, CheckpointFolder, HFFolder,
                                   model_file_in, read_bytes, read_json)

__all__ = ["ADAPTER", "is_adapter", "open_tensors"]

ADAPTER = "adapter"  # the kind of a LoRA adapter's own tensors
# the small files a model folder may carry beside its weights (config, generation config, tokenizer)
_MODEL_SIDE = (HFFolder.config, HFFolder.generation_config, *HFFolder.TOKENIZER_FILES)
_ADAPTER_SIDE = (HFFolder.adapter_config, HFFolder.peft_full_config, *HFFolder.TOKENIZER_FILES)


def is_adapter(src: Path) -> bool:
    """A LoRA adapter: a PEFT checkpoint (its ``model/`` holds ``adapter_config.json``) or an adapter folder."""
    src = Path(src)
    return src.is_dir() and any(os.path.lexists(d.adapter_config) for d in (HFFolder(src), CheckpointFolder(src).model))


@contextmanager
def open_tensors(src: Path, *, adapters_as_adapters: bool = True) -> Iterator[ModelSource]:
    """The tensors of ``src``; a LoRA adapter as its adapter tensors (``adapters_as_adapters``) or merged into its
    base (a full model: what evaluation needs)."""
    src = Path(src)
    if not src.exists():
        raise UserError(f"'{src}' does not exist; give a checkpoint, an export folder, an archive or a run folder")
    if adapters_as_adapters and is_adapter(src):
        with ExitStack() as stack:
            yield _adapter(src, stack)
        return
    with open_model(src) as model:
        if is_int8(model.config):
            model = dequantize_int8(model)
        model.side = _side_files(model.side_dir, _MODEL_SIDE)
        yield model


def _side_files(folder: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """The small files of ``folder`` among ``names``: regular files, or a Hugging Face cache snapshot's links into
    its blobs (``paths.model_file_in``); any other link is refused in one line."""
    out = {}
    for name in names:
        path = folder / name
        if os.path.lexists(path):
            try:
                real = model_file_in(folder, name, "it is not read")
                out[name] = read_bytes(real, "a model folder's small file", INDEX_FILE_LIMIT, follow=True)
            except OSError as exc:
                raise CheckpointError(f"cannot read '{path}': {exc.strerror or exc}") from None
    return out


def _adapter(src: Path, stack: ExitStack) -> ModelSource:
    from safetensors import safe_open

    model = CheckpointFolder(src).model
    folder = model.path if os.path.lexists(model.adapter_config) else src
    if folder is not src and folder.is_symlink():
        raise CheckpointError(f"'{folder}' is a symlink; folders inside a checkpoint are never followed as links")
    config = read_json(model_file_in(folder, HFFolder.adapter_config, "it is not read"), "an adapter config",
                               SMALL_FILE_LIMIT, follow=True)
    if not isinstance(config, dict):
        raise CheckpointError(f"'{HFFolder(folder).adapter_config}' is not a JSON object")
    if not os.path.lexists(HFFolder(folder).adapter_weights):
        raise CheckpointError(f"'{folder}' has no {HFFolder.adapter_weights} (an adapter stored as a pickle is never "
                              "read)")
    weights = model_file_in(folder, HFFolder.adapter_weights, "it is not read")
    try:
        handle = stack.enter_context(safe_open(str(weights), framework="pt"))
    except Exception as exc:  # safetensors' own checks of the header: sizes, offsets, dtypes
        raise CheckpointError(f"'{weights}' is not a readable safetensors file: {exc}") from None
    tensors = ModelSource(config, kind=ADAPTER, where=str(src), side=_side_files(folder, _ADAPTER_SIDE))
    for name in handle.keys():
        sliced = handle.get_slice(name)
        tensors.shapes[name] = tuple(int(d) for d in sliced.get_shape())
        tensors.dtypes[name] = ST_TO_TORCH.get(sliced.get_dtype())
        if tensors.dtypes[name] is None:
            raise CheckpointError(f"'{weights}' holds a tensor of dtype {sliced.get_dtype()}, which is not read here")
        tensors.readers[name] = lambda name=name: handle.get_tensor(name)
    return tensors

