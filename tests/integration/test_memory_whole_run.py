"""What training adds to a rank's memory after the setup stays within a bound set by the model's size (2 processes),
and what a backward through FSDP2 blocks holds on the CPU.

The run is ``tools/bench_memory.py``'s recipe on a small many-layer Llama folder base (most weights between 1 MiB
and 32 MiB: the blocks glibc's adaptive mmap threshold moves onto its heap), two micro-batches per rank and step.
Without ``distributed/allocator.py`` (``AUTOMODEL_CKPT_MALLOC=default``) each rank's peak rises about 6 x the model's
fp32 bytes above its post-setup level; when the first micro-batch's gradients wait unsharded for the second, 1.7 x;
as shipped, 1.3 x.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.integration import forked_ranks
from tests.integration.harness import env_for, launch_failure

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_memory.py"
CONFIG = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1408,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_steps_peak_above_the_setup_is_bounded_by_the_models_size(tmp_path):
    bench = _bench()
    base = bench.write_base(tmp_path / "base", CONFIG)
    run = bench.run_one(tmp_path, base, 2, 1, False, optimizer="sgd", save=False)
    assert "failed" not in run, run.get("failed")
    for rank in run["ranks"]:
        model_fp32 = 4 * rank["total_params"]
        # A step holds the rank's gradients (and optimizer state: none for SGD without momentum) for good, and for a
        # while the gathered root and a block or two with their unsharded gradients, and what the libraries allocate
        # on a first step: less than the whole fp32 model. The whole model's unsharded gradients are not among them.
        kept = rank["state_share"] - rank["params_share"]
        bound = kept + model_fp32
        assert rank["after_setup"] <= bound, (
            f"the steps added {rank['after_setup'] / 2**20:.0f} MiB to the setup's {rank['post_setup'] / 2**20:.0f} "
            f"MiB; bound {bound / 2**20:.0f} MiB (fp32 model {model_fp32 / 2**20:.0f} MiB)")


def test_a_backward_on_the_cpu_holds_one_gathered_block_and_its_gradients_at_a_time(tmp_path):
    """FSDP2's defaults, made for GPUs (the next block gathered ahead in backward, each reduce-scatter's input kept
    to the next one), held 3 blocks above the gradient shards here; the CPU's synchronous collectives overlap nothing,
    so ``shard_model`` turns both off there: 2 blocks (the gathered one and its unsharded gradients)."""
    done = forked_ranks.launch(2, Path(__file__).with_name("fsdp_backward_memory.py"), env=env_for(tmp_path))
    assert done.returncode == 0, launch_failure(done)
    ranks = re.findall(r"rank (\d): backward peak (\d+), kept (\d+), block (\d+)", done.stdout)
    assert len(ranks) == 2, done.stdout
    for rank, peak, kept, block in ranks:
        held = (int(peak) - int(kept)) / int(block)
        assert held <= 2.5, f"rank {rank}'s backward held {held:.2f} blocks above its gradient shards (goal 2)"
