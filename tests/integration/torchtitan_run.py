"""A real torchtitan run of the tiny Llama's shape on CPU (gloo), for the import tests: each rank of a torchrun job.

``python -m tests.integration.forked_ranks 2 tests/integration/torchtitan_run.py RECIPE ASSETS OUT`` builds
torchtitan's own Llama 3 (``Llama3Model``, fused QKV as its registry's flavors have it) in the tiny Llama's shape,
loads the tiny base into it through torchtitan's ``Llama3StateDictAdapter.from_hf``, shards it with FSDP2 over the two
ranks, and trains ``STEPS`` steps with torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``
(linear warmup, cosine decay to ``min_lr_factor``) on the recipe's rows in order, each rank taking its half of each
step's batch through torchtitan's ``ParallelAwareDataloader``. torchtitan's ``CheckpointManager`` saves at step
``SAVED_AT`` into ``OUT/dump/checkpoint/step-6`` (model, optimizer, lr_scheduler, dataloader, train_state: its
trainer's state); rank 0 writes the job config as ``--debug.save_config_file job_config.json`` writes it
(``Trainer.Config.to_dict()`` into ``OUT/dump/``).
Its trainer (``torchtitan.trainer.Trainer``) is not run: it needs a tokenizer and dataset of its own, and builds its
model on an accelerator. Rank 0 writes ``OUT/reference.json`` (each step's loss over its tokens, and lr),
``OUT/logits.pt`` (the model's logits at step 6 on ``interop.check.probe_inputs``) and ``OUT/theirs.pt``: the weights
and both AdamW moments at step 6 in HF names as torchtitan's own code gives them (the fused QKV moments split by
``FusedQKVLinear``'s state-dict hook, every tensor renamed and permuted by the adapter's ``to_hf``).

``python -m tests.integration.torchtitan_run --logits ASSETS CHECKPOINT OUT.pt`` (one process) puts the weights of
one of our checkpoints (HF names) into torchtitan's model through ``from_hf`` and writes its logits on the probe tokens:
the way back of the round trip.

torchtitan 0.3.0 imports its expert-parallel kernels at module level, which need triton (absent from a CPU torch):
``import_torchtitan`` puts a placeholder module in their place (no kernel of it runs in a dense model).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from torch.utils.data import IterableDataset

BATCH, STEPS, SAVED_AT = 12, 10, 6
LR, WARMUP, MIN_LR_FACTOR = 3e-3, 2, 0.1
KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def import_torchtitan() -> None:
    """torchtitan importable without triton: its expert-parallel kernels' module is a placeholder."""
    stub = types.ModuleType(KERNELS)

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError(f"{name} needs triton"))

    stub.__getattr__ = missing
    sys.modules.setdefault(KERNELS, stub)


#: What each rank imports, imported once before the ranks fork (``forked_ranks.launch(preload=...)``): this module
#: first, whose import puts the kernels' placeholder in place.
PRELOAD = ("tests.integration.torchtitan_run", "torchtitan.models.llama3",
           "torchtitan.models.common.attention", "torchtitan.components.checkpoint",
           "torchtitan.components.dataloader", "torchtitan.components.optimizer", "torchtitan.trainer")


def model_config(hf_config: dict):
    """torchtitan's ``Llama3Model.Config`` in the shape of an HF Llama's ``config.json`` (as its registry's flavors
    are built: fused QKV, FlexAttention, complex RoPE without scaling)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads, vocab = hf_config["hidden_size"], hf_config["num_attention_heads"], hf_config["vocab_size"]
    rope = hf_config.get("rope_parameters") or {}
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=hf_config["rms_norm_eps"], param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=hf_config["num_hidden_layers"], dim=dim, n_heads=heads,
            n_kv_heads=hf_config["num_key_value_heads"], hidden_dim=hf_config["intermediate_size"],
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=hf_config["max_position_embeddings"],
                                    theta=rope.get("rope_theta", 10000.0)),
            attn_backend="flex"))
    for layer in config.layers:  # FlexAttention has no backward on CPU: torchtitan's causal SDPA in its place
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


class Rows(IterableDataset):
    """The rows a rank reads, in order, as an iterable dataset with a position (what torchtitan's datasets are)."""

    def __init__(self, rows: list[dict]):
        super().__init__()
        self.rows, self.index = rows, 0

    def __iter__(self):
        while self.index < len(self.rows):
            self.index += 1
            yield self.rows[self.index - 1]

    def state_dict(self) -> dict:
        return {"sample_idx": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["sample_idx"]


class TrainState:
    """The trainer's own entry of a torchtitan checkpoint (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def main(argv: list[str]) -> None:
    recipe, assets, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    import_torchtitan()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    from transformers import AutoModelForCausalLM, default_data_collator

    from automodel_ckpt.interop.check import probe_inputs
    from tests.integration.foreign_trainers import recipe_rows

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = assets / "tiny_llama_base"
    config = model_config(json.loads((base / "config.json").read_text()))
    adapter = Llama3StateDictAdapter(config, None)
    model = config.build()
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(adapter.from_hf(dict(hf.state_dict())))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    kwargs = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    configs = {"optimizer": OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)],
        implementation="for-loop"),
        "lr_scheduler": LRSchedulersContainer.Config(warmup_steps=WARMUP, decay_type="cosine",
                                                     min_lr_factor=MIN_LR_FACTOR),
        "checkpoint": CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVED_AT, keep_latest_k=0)}
    optimizers = OptimizersContainer(configs["optimizer"], model_parts=[model])
    schedulers = configs["lr_scheduler"].build(optimizers=optimizers, training_steps=STEPS)
    micro = BATCH // world
    rows = recipe_rows(recipe)
    mine = [row for step in range(STEPS) for row in rows[step * BATCH + rank * micro:step * BATCH + (rank + 1) * micro]]
    loader = ParallelAwareDataloader(Rows(mine), rank, world, batch_size=micro, collate_fn=default_data_collator)
    state = TrainState()
    dump = out / "dump"
    checkpointer = CheckpointManager(
        configs["checkpoint"], dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=adapter, base_folder=str(dump))
    if rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "job_config.json").write_text(json.dumps(job_config(config, configs, micro), indent=2))

    record: dict[str, dict[int, float]] = {"loss": {}, "lr": {}}
    batches = iter(loader)
    for step in range(1, STEPS + 1):
        batch = next(batches)
        record["lr"][step] = schedulers.schedulers[0].get_last_lr()[0]
        ids, labels = batch["input_ids"], batch["labels"]
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = model(ids, positions=positions)
        # the loss over the step's tokens, as ours reports it: FSDP averages the ranks' gradients
        targets = labels[:, 1:]
        tokens = torch.stack([(targets != -100).sum().float()])
        dist.all_reduce(tokens)
        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                 reduction="sum")
        (summed * world / tokens[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        total = summed.detach().reshape(1)
        dist.all_reduce(total)
        record["loss"][step] = (total / tokens).item()
        state.step, state.ntokens_seen = step, state.ntokens_seen + int(tokens.item())
        checkpointer.save(step)
        if step == SAVED_AT:
            _write_theirs(model, optimizers, adapter, FusedQKVLinear, probe_inputs, out, rank)
    if rank == 0:
        (out / "reference.json").write_text(json.dumps(record))
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


def job_config(model, configs: dict, micro: int) -> dict:
    """The job config as its trainer writes it with ``--debug.save_config_file`` (``Trainer.Config.to_dict``): the
    run's model, optimizer, schedule and checkpoint configs, its batch and steps."""
    from torchtitan.config.configs import TrainingConfig
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    spec = ModelSpec(name="llama3", flavor="tiny", model=model, parallelize_fn=None, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    training = TrainingConfig(local_batch_size=micro, global_batch_size=BATCH, seq_len=16, steps=STEPS)
    return Trainer.Config(model_spec=spec, dump_folder="dump", training=training, **configs).to_dict()


def _write_theirs(model, optimizers, adapter, fused, probe_inputs, out: Path, rank: int) -> None:
    """The model's logits on the probe tokens, and its weights and moments in HF names by torchtitan's own code."""
    import torch
    from torch.distributed.tensor import DTensor

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        flat = {}
        for name, value in optimizers.state_dict().items():
            if name.startswith("state.") and name.endswith("." + key):
                flat[name[len("state."):-len(key) - 1]] = value.full_tensor() if isinstance(value, DTensor) else value
        for name in [n for n in flat if n.endswith(".wqkv.weight")]:
            module = model.get_submodule(name[:-len(".wqkv.weight")])
            split = {name: flat.pop(name)}
            fused._split_qkv_on_save(module, split, name[:-len("wqkv.weight")], None)
            flat.update(split)
        moments[key] = adapter.to_hf(flat)
    with torch.no_grad():
        ids = probe_inputs(adapter.model_config.vocab_size)
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = model(ids, positions=positions)
    if rank == 0:
        torch.save({"weights": adapter.to_hf(full), **moments}, out / "theirs.pt")
        torch.save(logits.float(), out / "logits.pt")


def logits_of(assets: Path, checkpoint: Path, out: Path) -> None:
    """torchtitan's model holding ``checkpoint``'s weights (through its adapter's ``from_hf``): its probe logits."""
    import_torchtitan()
    import torch
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    from automodel_ckpt.interop.check import probe_inputs

    config = model_config(json.loads((assets / "tiny_llama_base" / "config.json").read_text()))
    model = config.build()
    weights = {}
    for shard in sorted((checkpoint / "model").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    model.load_state_dict(Llama3StateDictAdapter(config, None).from_hf(weights), strict=True)
    ids = probe_inputs(config.vocab_size)
    with torch.no_grad():
        torch.save(model(ids, positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)).float(), out)


import_torchtitan()  # on import: a launcher preloading torchtitan (``PRELOAD``) imports this module first

if __name__ == "__main__":
    if sys.argv[1] == "--logits":
        logits_of(*map(Path, sys.argv[2:5]))
    else:
        main(sys.argv[1:])
