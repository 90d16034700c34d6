"""The peers of ``tools/bench_train.py``: the Hugging Face Trainer and a bare PyTorch loop, run on the same rows.

    python tools/bench_train_peers.py hf|bare|bare-ddp|bare-fsdp2 --spec SPEC.json --out DIR

One process of one peer (under ``torch.distributed.run`` for several): it builds the Llama of ``SPEC.json``
(``transformers.LlamaConfig``, seeded random init, fp32 weights), trains it on the rows of ``spec["rows"]`` (an
``.npy`` of token ids, every one a label) for ``spec["steps"]`` optimizer steps and writes ``DIR/rank<R>.json``:
each step's wall time (from fetching its batch to the end of the optimizer step, the device synchronised) and the
process's peak memory (``ru_maxrss``; on CUDA also ``torch.cuda.max_memory_allocated``).

* ``hf``: ``transformers.Trainer`` with its defaults (``adamw_torch_fused``, DDP over the processes), the
  hyper-parameters of the spec, no logging, saving or evaluation, offline. A step is timed from the batch fetch
  (``Trainer.get_batch_samples``) to ``on_step_end``; ``on_step_begin`` to ``on_step_end`` is kept beside it.
* ``bare``: a plain loop, one process; ``bare-ddp``: the model replicated with ``DistributedDataParallel``;
  ``bare-fsdp2``: sharded with ``fully_shard`` per decoder layer and on the root. Fused AdamW, clip 1.0, the
  model's own loss (``labels=``). bf16: autocast (plain, DDP) or FSDP2's ``MixedPrecisionPolicy`` (bf16 compute,
  fp32 reduction), fp32 weights either way.

This module imports neither the trainer under test nor anything of it: its peers run as a user would run them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

#: Model sizes: ``transformers.LlamaConfig`` arguments (tied embeddings, grouped-query attention).
SIZES: dict[str, dict] = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "26m": {"vocab_size": 32000, "hidden_size": 384, "intermediate_size": 1152, "num_hidden_layers": 8,
            "num_attention_heads": 6, "num_key_value_heads": 2},
    "120m": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2816, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4},
    "1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0},  # Llama 3.2 1B's shape
}
COMMON = {"model_type": "llama", "tie_word_embeddings": True, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PEERS = ("hf", "bare", "bare-ddp", "bare-fsdp2")


def llama_config(size: str) -> dict:
    """The ``LlamaConfig`` arguments of ``size`` (with ``model_type``: ``model.config`` of a recipe takes it)."""
    return COMMON | SIZES[size]


def parameter_count(config: dict) -> int:
    """Parameters of the model ``config`` builds (a tied embedding once), counted on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**_hf_args(config)))
    return sum(p.numel() for p in model.parameters())


def _hf_args(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "model_type"}


def _build(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    return LlamaForCausalLM(LlamaConfig(**_hf_args(spec["config"])))


def _rows(spec: dict, rank: int, world: int):
    """This rank's rows: every ``world``-th row of the spec's, starting at ``rank`` (as a distributed sampler)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.load(spec["rows"]).astype(np.int64))[rank::world]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peaks(device) -> dict:
    import torch

    peaks = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if device.type == "cuda":
        peaks["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return peaks


def run_hf(spec: dict, out: Path) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cpu, hyper = spec["device"] == "cpu", spec["hyper"]
    rows = _rows(spec, 0, 1)  # the Trainer's sampler gives each rank its share

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": rows[i], "labels": rows[i]}

    marks: dict[str, list[float]] = {"fetch": [], "begin": [], "end": []}

    class Timed(Trainer):
        def get_batch_samples(self, *args, **kwargs):
            marks["fetch"].append(time.perf_counter())
            return super().get_batch_samples(*args, **kwargs)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            _sync(args.device)
            marks["end"].append(time.perf_counter())

    targs = TrainingArguments(
        output_dir=str(out / "hf_output"), per_device_train_batch_size=spec["micro_batch"], max_steps=spec["steps"],
        gradient_accumulation_steps=1, learning_rate=hyper["lr"], weight_decay=hyper["weight_decay"],
        adam_beta1=hyper["betas"][0], adam_beta2=hyper["betas"][1], adam_epsilon=hyper["eps"],
        max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        bf16=spec["dtype"] == "bf16", use_cpu=cpu, ddp_backend="gloo" if cpu and world > 1 else None,
        dataloader_num_workers=0, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, push_to_hub=False)
    trainer = Timed(model=_build(spec), args=targs, train_dataset=Rows(), callbacks=[StepClock()])
    trainer.train()
    _part()
    device = targs.device
    steps = [end - fetch for fetch, end in zip(marks["fetch"], marks["end"])]
    begin_end = [end - begin for begin, end in zip(marks["begin"], marks["end"])]
    _write(out, rank, {"step_seconds": steps, "step_seconds_begin_to_end": begin_end,
                       "optimizer": _describe(getattr(trainer.optimizer, "optimizer", trainer.optimizer)),
                       "optim": targs.optim if isinstance(targs.optim, str) else targs.optim.value} | _peaks(device))


def run_bare(spec: dict, out: Path, mode: str) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if mode != "bare":
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    bf16 = spec["dtype"] == "bf16"
    model = _build(spec).to(device)
    if mode == "bare-ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    elif mode == "bare-fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    hyper = spec["hyper"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                                  weight_decay=hyper["weight_decay"], fused=True)
    autocast = bf16 and mode != "bare-fsdp2"
    rows, micro = _rows(spec, rank, world), spec["micro_batch"]
    model.train()
    steps = []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        batch = rows[step * micro:(step + 1) * micro].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        steps.append(time.perf_counter() - t0)
    _part()
    _write(out, rank, {"step_seconds": steps, "optimizer": _describe(optimizer)} | _peaks(device))


def _part() -> None:
    """Leave the process group together: no rank exits while another still talks to it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _describe(optimizer) -> str:
    fused = optimizer.defaults.get("fused")
    return f"{type(optimizer).__name__}(fused={fused})" if fused is not None else type(optimizer).__name__


def _write(out: Path, rank: int, record: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank} | record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--spec", type=Path, required=True, help="the run's spec (written by tools/bench_train.py)")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<R>.json")
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if args.peer == "hf":
        run_hf(spec, args.out)
    else:
        run_bare(spec, args.out, args.peer)


if __name__ == "__main__":
    sys.exit(main())
