"""``distributed/dcp_private.py`` hands on torch's own private DCP objects: each name is the object torch has under
its private name, and each helper does what torch's does (the one test file that imports those names)."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.distributed.checkpoint import _extension, _hf_utils, _nested_dict, _traverse, _version
from torch.distributed.checkpoint import default_planner, filesystem, planner_helpers, resharding
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from automodel_ckpt.distributed import dcp_private


def test_each_name_is_torchs_own():
    assert dcp_private.StorageInfo is filesystem._StorageInfo
    assert dcp_private.validate_global_plan is default_planner._validate_global_plan
    assert dcp_private.flatten_state_dict is _nested_dict.flatten_state_dict
    assert dcp_private.create_chunk_list is planner_helpers._create_chunk_list
    assert dcp_private.create_read_item_for_tensor is planner_helpers._create_read_item_for_tensor
    assert dcp_private.create_read_items is planner_helpers._create_read_items
    assert dcp_private.shards_overlap_region is resharding._shards_get_overlap_region_wrt_saved_tensor
    assert dcp_private.hf_storage_info() is _hf_utils._HFStorageInfo
    assert dcp_private.stream_extensions() == (_extension.ExtensionRegistry, _extension.StreamTransformExtension)
    assert [n for n in dcp_private.__all__ if not hasattr(dcp_private, n)] == []


def test_the_helpers_do_what_torchs_do():
    assert dcp_private.hf_file_name(2, 3, 1) == _hf_utils._gen_file_name(2, 3, 1)
    assert dcp_private.hf_file_name(1, 1) == _hf_utils._gen_file_name(1, 1)
    custom = json.dumps({"w": {"saved_offsets": [0]}})
    assert dcp_private.hf_shard_metadata(custom) == {_hf_utils.CUSTOM_METADATA_KEY: custom,
                                                     _hf_utils.DCP_VERSION_KEY: str(_hf_utils.HF_DCP_VERSION),
                                                     _hf_utils.FORMAT_KEY: _hf_utils.FORMAT_VALUE}
    model = nn.Sequential(nn.Linear(2, 2))
    assert dcp_private.get_fqns(model, "0.weight") == dcp_state_dict._get_fqns(model, "0.weight") == {"0.weight"}
    state = {"a": {"b": torch.zeros(1)}}
    flat, mappings = dcp_private.flatten_state_dict(state)
    dcp_private.set_element(state, mappings["a.b"], torch.ones(1))
    assert torch.equal(state["a"]["b"], torch.ones(1)) and list(flat) == ["a.b"]
    _traverse.set_element(state, mappings["a.b"], torch.zeros(1))
    assert torch.equal(state["a"]["b"], torch.zeros(1))


def test_the_old_key_scheme_is_set_for_its_block_alone():
    assert _version._derived_version is None
    with dcp_private.saved_before_2_4():
        assert _version._derived_version == "2_3"
    assert _version._derived_version is None
    try:
        with dcp_private.saved_before_2_4():
            raise KeyError("a failed flatten")
    except KeyError:
        pass
    assert _version._derived_version is None
