"""The private names of torch's distributed checkpoint (DCP) the package uses, in one place: no other module imports one.

Checked against torch 2.13.0 (the package supports torch>=2.7). Each is here because DCP offers no public way to do
what it does; when torch moves or renames one, this module and ``tests/unit/distributed/test_dcp_private.py`` are
what change. Names DCP itself imports at import time are bound at module level; the others are imported when
called, so a torch that lacks one fails only where it is used. Each name, and why (its source is beside it):

- ``StorageInfo``: where an item's bytes are in a ``.distcp`` file, made and read by ``fastio`` and ``plan_results``.
- ``validate_global_plan``: DCP's check of a global save plan, run by ``plan_checks`` where it proves nothing.
- ``dedup_save_plans``: DCP's dedup, for the save plans ``planning`` cannot plan on columns.
- ``flatten_state_dict``: a nested state dict's flat keys and mappings, as DCP's planners flatten it.
- ``saved_before_2_4()``: the flat keys of a checkpoint saved by torch < 2.4, as ``DefaultLoadPlanner`` reads one.
- ``create_chunk_list``, ``create_read_item_for_tensor``, ``create_read_items``, ``shards_overlap_region``: a
  load's read items made as DCP makes them, by ``planning``'s one-pass load planner.
- ``hf_storage_info()``: where a tensor is in a safetensors file (``export.archive_weights``).
- ``hf_file_name(index, total, shard)``, ``hf_shard_metadata(custom)``: a shard named and headed as torch's writer.
- ``get_fqns(model, name)``: a parameter's state-dict names as ``get_model_state_dict`` names them.
- ``stream_extensions()``: undo the stream transforms DCP recorded for a piece (``export.sources``).
- ``set_element(root, path, value)``: put a loaded byte entry back into a nested state dict, as DCP's loader does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _validate_global_plan as validate_global_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list as create_chunk_list
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_tensor as create_read_item_for_tensor
from torch.distributed.checkpoint.planner_helpers import _create_read_items as create_read_items
from torch.distributed.checkpoint.resharding import _shards_get_overlap_region_wrt_saved_tensor as shards_overlap_region

__all__ = ["StorageInfo", "validate_global_plan", "flatten_state_dict", "saved_before_2_4", "create_chunk_list",
           "create_read_item_for_tensor", "create_read_items", "shards_overlap_region", "hf_storage_info",
           "hf_file_name", "hf_shard_metadata", "get_fqns", "stream_extensions", "set_element", "dedup_save_plans"]


@contextmanager
def saved_before_2_4() -> Iterator[None]:
    """Within it, DCP flattens state dicts as torch < 2.4 saved them (``DefaultLoadPlanner``'s fallback)."""
    _version._derived_version = "2_3"
    try:
        yield
    finally:
        _version._derived_version = None


def hf_storage_info() -> type:
    """DCP's ``_HFStorageInfo`` class (relative path, offset, length, shape, dtype of a safetensors tensor)."""
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

    return _HFStorageInfo


def hf_file_name(index: int, total: int, shard: int | None = None) -> str:
    """The name torch's Hugging Face writer gives shard ``index`` of ``total`` (``shard``: a rank's own)."""
    from torch.distributed.checkpoint._hf_utils import _gen_file_name

    return _gen_file_name(index, total, shard)


def hf_shard_metadata(custom: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors shard as torch's Hugging Face writer writes it (``custom``: offsets)."""
    from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE,
                                                        HF_DCP_VERSION)

    return {CUSTOM_METADATA_KEY: custom, DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}


def get_fqns(model: Any, name: str) -> set[str]:
    """The state-dict names of ``model``'s parameter ``name`` (``ImportError`` where torch's helper moved)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return _get_fqns(model, name)


def stream_extensions() -> tuple[type, type]:
    """DCP's ``ExtensionRegistry`` and ``StreamTransformExtension`` (``ImportError`` where this torch has none)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    return ExtensionRegistry, StreamTransformExtension


def set_element(root: Any, path: Any, value: Any) -> None:
    """Set ``value`` at ``path`` (a ``flatten_state_dict`` mapping) in the nested state dict ``root``."""
    from torch.distributed.checkpoint._traverse import set_element as set_at

    set_at(root, path, value)
