"""formats/replicated.py: a replicated tensor saved as this rank's FSDP2 shard, a view made as ``from_local``
makes it, its placement worked out once per shape."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from automodel_ckpt.ondisk.formats import replicated


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_a_replicated_tensor_becomes_the_view_from_local_makes_and_its_placement_is_kept(process_group, ranks):
    mesh = DeviceMesh("cpu", torch.arange(ranks), _init_backend=False)  # this process is its rank 0
    replicated._shard_of.cache_clear()
    for shape in [(7, 5), (10,), (2, 3, 4), (1, 8)]:
        value = torch.randn(shape, requires_grad=True)
        local, offset = compute_local_shape_and_global_offset(value.shape, mesh, [Shard(0)])
        want = DTensor.from_local(value.detach().narrow(0, offset[0], local[0]), mesh, [Shard(0)], run_check=False,
                                  shape=value.shape, stride=value.stride())
        for _ in range(2):
            got = replicated._as_shards(value, mesh)
            assert got._spec == want._spec and got.placements == (Shard(0),) and not got.requires_grad
            assert torch.equal(got.to_local(), want.to_local()) and got.to_local().data_ptr() == value.data_ptr()
    assert replicated._shard_of.cache_info().hits == 4 and replicated._shard_of.cache_info().misses == 4
    scalar = torch.tensor(1.0)
    assert replicated._as_shards(scalar, mesh) is scalar and replicated._as_shards("x", mesh) == "x"
