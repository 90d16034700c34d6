"""Run on 2 forked ranks: a backward through FSDP2 blocks on the CPU holds, above what it keeps (each rank's gradient
shards), one gathered block and its unsharded gradients at a time, not the next block too or a reduce-scatter's input.

Memory is the process's resident high-water mark, with the allocator as a sharded run sets it (blocks of 1 MiB and
more mapped and unmapped), measured over the second step (the first one faults in the code its kernels run).
Prints one line per rank: ``rank R: backward peak P, kept K, block B`` (bytes).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_ckpt.distributed.allocator import return_freed_memory
from automodel_ckpt.distributed.env import end_process, init_distributed, shutdown_distributed
from automodel_ckpt.distributed.fsdp import data_parallel_mesh, shard_model


def _resident(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def main() -> None:
    return_freed_memory()
    env = init_distributed("gloo", 10)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=1024, intermediate_size=4096, num_hidden_layers=3,
                                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False))
    block = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    model = shard_model(model, data_parallel_mesh(torch.device("cpu"), env.world_size))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(env.rank))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        Path("/proc/self/clear_refs").write_text("5")  # a new high-water mark, from here
        start = _resident("VmRSS")
        loss.backward()
        peak = _resident("VmHWM") - start
    kept = sum(4 * p.grad.to_local().numel() for p in model.parameters())
    print(f"rank {env.rank}: backward peak {peak}, kept {kept}, block {block}", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    end_process(0)
