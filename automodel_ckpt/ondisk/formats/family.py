"""On-disk tensor layout of a model family: which saved tensor, and which part of it, each exported tensor is.

Asked of transformers itself, so that a family it adds exports in its own layout: docs/consolidation.md."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskTensor:
    """One on-disk tensor: elements ``offset + sum(i_k * stride_k)`` of the saved tensor ``source``."""

    name: str
    source: str
    shape: tuple[int, ...]
    offset: int
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """Whether it is one run of consecutive elements of the source (then it streams piece by piece)."""
        return self.stride == c_strides(self.shape) or math.prod(self.shape) <= 1

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        return self.offset == 0 and self.shape == tuple(source_shape) and self.contiguous


def family_of(config: Mapping[str, Any] | None) -> str | None:
    """The ``model_type`` of an HF config dict (``llama``, ``mixtral``, ...), or None."""
    if not config:
        return None
    value = config.get("model_type")
    return str(value) if value else None


def disk_layout(config: Mapping[str, Any] | None, saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                base_names: Collection[str] | None = None) -> dict[str, DiskTensor] | None:
    """On-disk name -> where it lies in the saved tensors ``saved`` (name -> (shape, dtype)); None when the layout
    is no views of single saved tensors. ``base_names``: the base folder's names, which decide, as in
    ``from_pretrained``, the conversions that depend on how the base was stored (older LLaVA's ``vision_model.``)."""
    family = family_of(config)
    if family is None:
        return None
    model = _meta_model(dict(config or {}))
    if model is None:
        return None
    from transformers.core_model_loading import revert_weight_conversion

    if base_names:
        _record_conversions_of(model, base_names)

    dropped = _tied_copies(model, saved)
    sources = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in saved.items()}
    kept = {name: t for name, t in sources.items() if name not in dropped}
    try:
        with torch.no_grad(), _KeepViews():
            reverted = revert_weight_conversion(model, dict(kept))
    except Exception as e:  # noqa: BLE001 - any failure of transformers' conversion means: keep saved names
        logger.warning("cannot map the %s checkpoint to its on-disk names (%s); the export keeps the saved names",
                       family, e)  # fmt: skip
        return None
    by_id = {id(t): name for name, t in kept.items()}
    out: dict[str, DiskTensor] = {}
    for name, tensor in reverted.items():
        root = tensor if id(tensor) in by_id else tensor._base
        source = by_id.get(id(root)) if root is not None else None
        if source is None:
            logger.warning("%s: on-disk tensor '%s' combines several saved tensors, which the streaming export does "
                           "not support; the export keeps the saved names", family, name)
            return None
        out[name] = DiskTensor(name, source, tuple(tensor.shape), tensor.storage_offset(), tuple(tensor.stride()))
    if dropped:
        logger.info("%s: tied weight(s) written once, as save_pretrained does: %s left out", family,
                    ", ".join(sorted(dropped)))  # fmt: skip
    return out


def in_memory_dtypes(model: Any, disk_dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.dtype]:
    """Dtypes of the base's on-disk tensors under ``model``'s in-memory names (a fused stack: its experts')."""
    state = model.state_dict()
    disk = disk_layout(model.config.to_dict(), {k: (tuple(v.shape), v.dtype) for k, v in state.items()},
                       base_names=list(disk_dtypes))
    if disk is None:
        return dict(disk_dtypes)
    out: dict[str, torch.dtype] = {}
    for name, view in disk.items():
        if name in disk_dtypes:
            out.setdefault(view.source, disk_dtypes[name])
    return out


def _meta_model(config: dict[str, Any]) -> Any | None:
    """The family's model built from ``config`` on the meta device, or None when transformers lacks it."""
    from transformers import AutoConfig

    family = config.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(family, **config)
        with torch.device("meta"):
            return auto_model_class(hf_config).from_config(hf_config)
    except (ValueError, KeyError, TypeError, ImportError) as e:
        logger.warning("model family '%s' is unknown to this transformers (%s); the export keeps the saved names",
                       family, e)  # fmt: skip
        return None


def _record_conversions_of(model: Any, base_names: Collection[str]) -> None:
    """Attach to ``model`` the conversions that loading ``base_names`` would use, as ``from_pretrained`` does, so
    that ``revert_weight_conversion`` reverts exactly those (prefix changes included) and no others."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    for name in base_names:
        rename_source_key(name, renamings, converters)
    model._weight_conversions = [m for m in mapping if m.was_used()]  # noqa: SLF001 - what from_pretrained records


def auto_model_class(config: Any) -> Any:
    """The transformers auto class for ``config`` (or a model folder): image-text-to-text, else causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if not hasattr(config, "model_type"):
        config = AutoConfig.from_pretrained(str(config))
    image_text = AutoModelForImageTextToText._model_mapping  # noqa: SLF001 - the auto class's own registry
    causal = AutoModelForCausalLM._model_mapping  # noqa: SLF001
    return AutoModelForImageTextToText if type(config) in image_text and type(config) not in causal \
        else AutoModelForCausalLM


def _tied_copies(model: Any, saved: Mapping[str, Any]) -> set[str]:
    """Saved names ``save_pretrained`` leaves out because they are tied to another weight (e.g. ``lm_head``)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    return {name for name in state if name not in kept and name in saved}


class _KeepViews(TorchDispatchMode):
    """Makes copies return their input, so that converted tensors remain views of the tensors they come from."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):
            if func is torch.ops.aten.clone.default:
                return first
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", first.dtype) == first.dtype:
                return first
        return func(*args, **kwargs)


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)
