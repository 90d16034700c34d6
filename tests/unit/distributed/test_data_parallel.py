"""``distributed.dp_shard``: which data-parallel strategy a run gets on its mesh, for its model, and why."""

from __future__ import annotations

import pytest
import torch

from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.data_parallel import REPLICATED, SHARDED, UNWRAPPED, choose, replicated_bytes
from automodel_ckpt.distributed.mesh import MeshSizes, ParallelDims
from automodel_ckpt.errors import ConfigError

CPU = torch.device("cpu")


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))  # 10,110 parameters
    model[1].requires_grad_(False)
    return model


def _dims(**sizes) -> ParallelDims:
    return ParallelDims(MeshSizes(**sizes), 0)


def test_the_replicated_state_is_parameters_gradients_and_two_moments_of_what_trains():
    assert replicated_bytes(_model()) == 10100 * 4 * 4 + 1010 * 4


def test_one_data_parallel_rank_wraps_nothing():
    choice = choose("auto", _dims(dp_shard=1), _model(), CPU)
    assert choice.kind == UNWRAPPED
    assert data_parallel.wrap(_model(), choice, _dims(dp_shard=1)).__class__ is torch.nn.Sequential
    assert choice.describe() == "Data parallelism: unwrapped (one data-parallel rank: nothing to exchange)"


def test_auto_replicates_what_fits_its_share_and_shards_the_rest():
    need = replicated_bytes(_model())
    fits = choose("auto", _dims(dp_shard=2), _model(), CPU, memory=need * 4)
    assert fits.kind == REPLICATED and "replicated up to 25%" in fits.reason
    too_big = choose("auto", _dims(dp_shard=2), _model(), CPU, memory=need * 4 - 1)
    assert too_big.kind == SHARDED and "more than 25%" in too_big.reason


def test_full_always_shards_and_none_always_replicates():
    assert choose("full", _dims(dp_shard=1), _model(), CPU).kind == SHARDED
    assert choose("none", _dims(dp_shard=2), _model(), CPU, memory=1).kind == REPLICATED


@pytest.mark.parametrize("sizes,name", [({"tp": 2}, "tensor"), ({"pp": 2}, "pipeline"), ({"ep": 2}, "expert"),
                                        ({"dp_replicate": 2, "dp_shard": 2}, "HSDP")])
def test_other_parallelism_shards_with_fsdp2(sizes, name):
    choice = choose("auto", _dims(**sizes), _model(), CPU, memory=1 << 40)
    assert choice.kind == SHARDED and name in choice.reason
    with pytest.raises(ConfigError, match=f"distributed.dp_shard: none cannot be combined with {name}"):
        choose("none", _dims(**sizes), _model(), CPU)


def test_an_unknown_setting_is_one_line():
    with pytest.raises(ConfigError, match="distributed.dp_shard: expected one of auto, full, none, got 'half'"):
        choose("half", _dims(dp_shard=2), _model(), CPU)


def test_replicated_and_unwrapped_models_compute_under_autocast_with_mixed_precision():
    layer = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with choose("auto", _dims(dp_shard=1), layer, CPU, mixed_precision="bf16").compute(CPU):
        assert layer(x).dtype == torch.bfloat16
    with choose("auto", _dims(dp_shard=1), layer, CPU).compute(CPU):
        assert layer(x).dtype == torch.float32
    with choose("full", _dims(dp_shard=1), layer, CPU, mixed_precision="bf16").compute(CPU):  # FSDP2 casts itself
        assert layer(x).dtype == torch.float32
