"""`ckpt-train import` of a hostile source: no link followed, no file read past its bound, no value taken unchecked.

Tiny genuine sources are crafted once per module, as their trainers write them, for a recipe whose model (a one-layer
Llama built from ``model.config``) holds some 13,000 parameters: a Trainer ``checkpoint-N/``, a Lightning ``.ckpt``
and distributed checkpoint folder, a DeepSpeed ZeRO-2 save folder and a torchtitan dump folder (``checkpoint/step-1/``
and its job config). Each case copies one and tampers one file: a link out of it (a file, a folder on the way, a data
file of a DCP folder) or inside it, a FIFO, a sparse file far larger than the recipe's model allows (8 GiB for a
``.ckpt``, a shard or the weights), a DCP ``.metadata`` that would run code or claims a huge tensor, a torn folder, a
value of the Trainer's log history that is no finite number. Run through the corpus's limited child processes: one
``error:`` line naming the file, non-zero exit, no traceback or memory error, nothing outside opened or copied in
(inotify, snapshot), no run folder written, and for the large files a peak memory within 150 MiB of an idle child's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.conftest import CODE, Case
from tests.hostile.harness import Outside, lean, refused

SFT = CODE / "recipes" / "tiny_llama_sft.yaml"
MODEL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}
HUGE = 8 * 2**30  # sparse: no disk space, but a reader that trusted it would allocate it all
BIG = 200 * 2**20
SHARD = "__0_0.distcp"
FIFO_TIMEOUT = 30


def _recipe(folder: Path) -> Path:
    """The tiny_llama_sft recipe with its model built from ``MODEL`` (no base folder to read)."""
    text = SFT.read_text().replace("  pretrained_model_name_or_path: ${oc.env:AUTOMODEL_CKPT_ASSETS,assets}/"
                                   "tiny_llama_base\n  embedded: tiny_llama\n",
                                   f"  pretrained_model_name_or_path: null\n  config: {json.dumps(MODEL)}\n")
    assert "config:" in text
    path = folder / "recipe.yaml"
    path.write_text(text)
    return path


def _trained():
    """The model, its AdamW after one step, as both trainers hold them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    return model, opt


def _hf_trainer(folder: Path, model, opt) -> Path:
    """A Trainer's ``checkpoint-1/`` of the linear schedule, at step 1 of 4."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 1, "base_lrs": [1e-3], "_last_lr": [7.5e-4]}, folder / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               folder / "rng_state.pth")
    torch.save(_training_args(folder), folder / "training_args.bin")
    (folder / "trainer_state.json").write_text(json.dumps({
        "global_step": 1, "max_steps": 4, "train_batch_size": 4, "epoch": 0.25,
        "log_history": [{"epoch": 0.25, "step": 1, "loss": 4.2, "learning_rate": 7.5e-4, "grad_norm": 1.5}]}))
    return folder


def _training_args(folder: Path):
    """The Trainer's arguments of ``checkpoint-1/``: the linear schedule over 4 steps, 4 rows a device."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(folder.parent / "out"), learning_rate=1e-3, max_steps=4,
                             lr_scheduler_type="linear", warmup_steps=0, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True)


def _lightning(path: Path, model, opt) -> Path:
    import torch

    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1,
                "optimizer_states": [opt.state_dict()], "lr_schedulers": [], "loops": {}}, path)
    return path


def _lightning_folder(folder: Path, model, opt) -> Path:
    """What ModelParallelStrategy saves: the weights (``state_dict.``) and ``optimizer_0`` by DCP, and ``meta.pt``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = torch.nn.Module()
    module.model = model
    state = {"state_dict": get_model_state_dict(module), "optimizer_0": get_optimizer_state_dict(module, opt)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 1, "lr_schedulers": [], "loops": {}}, folder / "meta.pt")
    assert (folder / SHARD).is_file()
    return folder


DS_TAG = "global_step1"
DS_RANK = "global_step1/zero_pp_rank_{}_mp_rank_00_optim_states.pt"
DS_MODEL = "global_step1/mp_rank_00_model_states.pt"
DS_CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                               "warmup_num_steps": 2, "total_num_steps": 4,
                                                               "warmup_type": "linear"}}}


def _deepspeed(folder: Path, model, opt) -> Path:
    """What ``engine.save_checkpoint`` writes for ZeRO-2 on 2 ranks, with DeepSpeed's keys (written here without
    DeepSpeed): ``latest``, the model states, each rank's half of the flat fp32 weights and of AdamW's moments."""
    from collections import OrderedDict

    import torch

    world, params = 2, list(model.named_parameters())
    def halves(tensors):
        flat = torch.cat([t.detach().flatten() for t in tensors])
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % (2 * world))])
        return list(flat.chunk(world))
    weights = halves([p for _, p in params])
    moments = {k: halves([opt.state[p][k] for _, p in params]) for k in ("exp_avg", "exp_avg_sq")}
    (folder / DS_TAG).mkdir(parents=True)
    (folder / "latest").write_text(DS_TAG)
    torch.save({"module": model.state_dict(), "buffer_names": [], "frozen_param_shapes": {}, "shared_params": {},
                "param_shapes": [OrderedDict((n, p.shape) for n, p in params)], "frozen_param_fragments": {},
                "lr_scheduler": {"last_batch_iteration": 0}, "global_steps": 1, "global_samples": 4,
                "dp_world_size": world, "mp_world_size": 1, "ds_config": DS_CONFIG, "ds_version": "0.19.8"},
               folder / DS_MODEL)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"} | {"lr": 0.0, "params": [0]}
    for rank in range(world):
        state = {0: {"step": torch.tensor(1.0), "exp_avg": moments["exp_avg"][rank].clone(),
                     "exp_avg_sq": moments["exp_avg_sq"][rank].clone()}}
        torch.save({"optimizer_state_dict": {
            "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0, "zero_stage": 2,
            "base_optimizer_state": {"state": state, "param_groups": [group]},
            "single_partition_of_fp32_groups": [weights[rank].clone()], "group_paddings": [0],
            "partition_count": [world], "ds_version": "0.19.8"}, "ds_config": DS_CONFIG},
            folder / DS_RANK.format(rank))
    return folder


def _deepspeed_trainer(folder: Path, trainer: Path, ds: Path) -> Path:
    """The HF Trainer's ``checkpoint-1/`` saved under DeepSpeed: its state, arguments and generators, with
    DeepSpeed's ``latest`` and tag folder in place of its weights, optimizer and scheduler files."""
    shutil.copytree(trainer, folder)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        (folder / name).unlink()
    shutil.copytree(ds / DS_TAG, folder / DS_TAG)
    shutil.copyfile(ds / "latest", folder / "latest")
    return folder


TT_STEP = "checkpoint/step-1"
TT_NAMES = {"embed_tokens": "tok_embeddings", "self_attn.q_proj": "attention.qkv_linear.wq",  # its adapter's map
            "self_attn.k_proj": "attention.qkv_linear.wk", "self_attn.v_proj": "attention.qkv_linear.wv",
            "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
            "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
            "post_attention_layernorm": "ffn_norm"}
TT_JOB = {"lr_scheduler": {"warmup_steps": 2, "total_steps": None, "decay_ratio": None, "decay_type": "linear",
                           "min_lr_factor": 0.0},
          "training": {"local_batch_size": 4, "global_batch_size": -1, "steps": 4},
          "checkpoint": {"folder": "checkpoint"}}


def _torchtitan(folder: Path, model, opt) -> Path:
    """What torchtitan's ``CheckpointManager`` writes at step 1 into its dump folder, with its keys (written here
    without torchtitan): the weights under its names, q and k rows permuted back for its RoPE (its adapter's
    ``from_hf``), the optimizer's state and param group by name with q, k and v fused into one ``wqkv`` slot (its
    ``FusedQKVLinear``), the scheduler's and trainer's counters, the data loader's pickled state; and its job config
    (``--debug.save_config_file job_config.json``)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    heads, kv = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]

    def theirs(name: str, t: torch.Tensor) -> torch.Tensor:
        n = {"q_proj": heads, "k_proj": kv}.get(name.split(".")[-2])
        return t if n is None else t.reshape(n, 2, t.shape[0] // n // 2, -1).transpose(1, 2).reshape(t.shape)

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        per = k.shape[0] // kv
        return torch.cat([q.reshape(kv, -1, per, q.shape[1]), k.reshape(kv, 1, per, -1), v.reshape(kv, 1, per, -1)],
                         1).reshape(-1, q.shape[1])

    def tt(name: str) -> str:
        for ours, their in TT_NAMES.items():
            name = name.replace(ours, their)
        return name.removeprefix("model.")

    params = dict(model.named_parameters())
    flat = {tt(n): theirs(n, p.detach()) for n, p in params.items()}
    slots = {tt(n): {k: theirs(n, v) if v.dim() else v for k, v in opt.state[p].items()} for n, p in params.items()}
    qkv = "layers.0.attention.qkv_linear."
    q, k, v = (slots.pop(qkv + f"{w}.weight") for w in ("wq", "wk", "wv"))
    slots[qkv + "wqkv.weight"] = {"step": q["step"], **{m: fused(q[m], k[m], v[m]) for m in ("exp_avg", "exp_avg_sq")}}
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"} | {"initial_lr": 1e-3}
    for name, slot in slots.items():
        flat |= {f"optimizer.state.{name}.{k}": v for k, v in slot.items()}
        flat |= {f"optimizer.param_groups.{name}.{k}": v for k, v in hyper.items()}
    flat |= {"lr_scheduler.last_epoch": 1, "train_state.step": 1, "train_state.ntokens_seen": 32,
             "dataloader.world_size": 1, "dataloader.dp_rank_0": pickle.dumps({"sample_idx": 4})}
    dcp.save(flat, checkpoint_id=folder / TT_STEP, no_dist=True)
    (folder / "job_config.json").write_text(json.dumps(TT_JOB))
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import warnings

    root = tmp_path_factory.mktemp("import_sources")
    model, opt = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves in one process
        made = {"trainer": _hf_trainer(root / "checkpoint-1", model, opt),
                "ckpt": _lightning(root / "last.ckpt", model, opt),
                "folder": _lightning_folder(root / "epoch=0-step=1.ckpt", model, opt),
                "deepspeed": _deepspeed(root / "ds", model, opt),
                "torchtitan": _torchtitan(root / "outputs", model, opt)}
    made["deepspeed-trainer"] = _deepspeed_trainer(root / "under_deepspeed" / "checkpoint-1", made["trainer"],
                                                   made["deepspeed"])
    return {**made, "recipe": _recipe(root)}


def test_the_genuine_sources_are_read(sources):
    """Every case below changes one thing of a source that the import reads whole."""
    import torch

    from automodel_ckpt.cli.import_run import source_limits
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.interop import read_source

    limits = source_limits(load_config(str(sources["recipe"]), [], RecipeConfig))
    assert limits.checkpoint < 64 * 2**20
    for kind in ("trainer", "ckpt", "folder", "deepspeed"):
        run = read_source(sources[kind], limits)
        assert run.step == 1 and run.weights, kind
    assert read_source(sources["trainer"], limits).log[0]["lr"] == 7.5e-4
    run = read_source(sources["deepspeed"], limits)  # every moment put together from the two ranks' halves
    model, opt = _trained()
    assert all(torch.equal(run.weights[n], p) and torch.equal(m["exp_avg"], opt.state[p]["exp_avg"])
               for (n, p), m in zip(model.named_parameters(), run.moments))
    under = read_source(sources["deepspeed-trainer"], limits)  # the Trainer's position, log and generators
    assert under.kind.startswith("DeepSpeed ZeRO-2") and under.position(16, 4) == (0, 1, 2) and under.rng is not None
    assert under.log[0]["loss"] == 4.2 and under.schedule.target.endswith("one_cycle")
    titan = read_source(sources["torchtitan"], limits)  # its layout once the recipe's model is known: the model's own
    assert titan.step == 1 and titan.global_batch == 4 and titan.schedule.target.endswith(".wsd")
    titan.fit(model)
    params = dict(model.named_parameters())
    assert all(torch.equal(titan.weights[n], p) for n, p in params.items())
    assert all(torch.equal(m[k], opt.state[params[n]][k]) for n, m in zip(titan.order(model), titan.moments)
               for k in ("exp_avg", "exp_avg_sq"))
    from automodel_ckpt.errors import CheckpointError
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"} |
                                         {"num_attention_heads": 4}))
    with pytest.raises(CheckpointError, match=r"wk.weight' is \[16, 32\], not 1 heads of 8: another model"):
        read_source(sources["torchtitan"], limits).fit(other)


# --- the tampering ---------------------------------------------------------------------------------------------------


def link_out(rel: str):
    """``rel`` a symlink to the file outside (in its place, or beside the others)."""
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).unlink(missing_ok=True)
        os.symlink(outside.secret, src / rel)
    return tamper


def link_inside(rel: str):
    """``rel`` a symlink to its own bytes moved beside it: a link that stays inside is not followed either."""
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).rename(src / f"{rel}.real")
        os.symlink(f"{rel}.real", src / rel)
    return tamper


def linked_folder(inside: bool):
    """The weights named by an index as ``shards/model.safetensors``, ``shards`` a symlink to a folder outside or
    (``inside``) to the folder beside it that holds them."""
    def tamper(src: Path, outside: Outside) -> None:
        if inside:
            (src / "real").mkdir()
            (src / "model.safetensors").rename(src / "real" / "model.safetensors")
        else:
            (src / "model.safetensors").unlink()
        os.symlink("real" if inside else outside.dir, src / "shards")
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "lm_head.weight": "shards/model.safetensors"}}))
    return tamper


def linked_fsdp_folder(src: Path, outside: Outside) -> None:
    os.symlink(outside.dir, src / "pytorch_model_fsdp_0")


def fifo(rel: str):
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).unlink()
        os.mkfifo(src / rel)
    return tamper


def sparse(rel: str, size: int):
    """``rel`` grown to ``size`` bytes of holes after its own."""
    def tamper(src: Path, outside: Outside) -> None:
        with open(src / rel if rel else src, "r+b") as f:
            f.truncate(size)
    return tamper


def logged(key: str, value: object):
    """The first entry of the Trainer's log history with ``key`` set to ``value`` (NaN written as JSON's ``NaN``)."""
    def tamper(src: Path, outside: Outside) -> None:
        state = json.loads((src / "trainer_state.json").read_text())
        state["log_history"][0][key] = value
        (src / "trainer_state.json").write_text(json.dumps(state))
    return tamper


def argued(key: str, value: object):
    """``training_args.bin`` with the field ``key`` set to ``value`` (as anyone who pickles the arguments can)."""
    def tamper(src: Path, outside: Outside | None) -> None:
        import torch

        args = _training_args(src)
        object.__setattr__(args, key, value)
        torch.save(args, src / "training_args.bin")
    return tamper


def stated(key: str, value: object):
    """``trainer_state.json`` with ``key`` set to ``value`` (NaN and infinities as JSON's ``NaN``, ``Infinity``)."""
    def tamper(src: Path, outside: Outside | None) -> None:
        state = json.loads((src / "trainer_state.json").read_text())
        state[key] = value
        (src / "trainer_state.json").write_text(json.dumps(state))
    return tamper


def pickled(name: str, change):
    """The torch-saved file ``name`` (of ``src``, or ``src`` itself) loaded, changed by ``change``, saved again."""
    def tamper(src: Path, outside: Outside | None) -> None:
        import torch

        path = src / name if name else src
        data = torch.load(path, weights_only=True)
        change(data)
        torch.save(data, path)
    return tamper


def grouped(key: str, value: object):
    """The optimizer's first param group with ``key`` set to ``value``."""
    def change(opt: dict) -> None:
        opt["param_groups"][0][key] = value
    return pickled("optimizer.pt", change)


def _scheduler_state(kind: str) -> dict:
    """A torch scheduler's state after one step, as Lightning saves it beside its optimizer."""
    import torch

    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched = {"cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
             "linear": lambda: torch.optim.lr_scheduler.LinearLR(opt, 0.5, 1.0, 4),
             "step": lambda: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
             "one_cycle": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=4)}[kind]()
    opt.step()
    sched.step()
    return sched.state_dict()


def scheduled_by(kind: str, key: str, value: object):
    """The Lightning ``.ckpt`` with one ``kind`` scheduler whose ``key`` is ``value``."""
    def change(ckpt: dict) -> None:
        ckpt["lr_schedulers"] = [{**_scheduler_state(kind), key: value}]
    return pickled("", change)


class _Payload:
    """Unpickled, it would create ``marker``: code run from a pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def ds_payload(src: Path, outside: Outside) -> None:
    """Rank 1's partition with an object whose unpickling would create a file outside."""
    import torch

    data = torch.load(src / DS_RANK.format(1), weights_only=True)
    data["optimizer_state_dict"]["loss_scaler"] = _Payload(outside.dir / "ran")
    torch.save(data, src / DS_RANK.format(1))


def ds_shape(name: str, shape: tuple[int, ...]):
    """The model states naming ``name`` of ``shape`` (the partitions unchanged)."""
    def change(states: dict) -> None:
        states["param_shapes"][0][name] = torch_size(shape)
    return pickled(DS_MODEL, change)


def torch_size(shape: tuple[int, ...]):
    import torch

    return torch.Size(shape)


def ds_missing(rank: int):
    def tamper(src: Path, outside: Outside) -> None:
        (src / DS_RANK.format(rank)).unlink()
    return tamper


def ds_frozen(states: dict) -> None:
    """The model states with a frozen parameter, as a LoRA run's base is (out of the optimizer's partitions)."""
    states["frozen_param_shapes"] = {"model.norm.weight": torch_size((MODEL["hidden_size"],))}


def ds_lora(states: dict) -> None:
    """The model states naming a LoRA weight, as a bare engine's PEFT model saved without its frozen base does."""
    shapes = states["param_shapes"][0]
    name = next(iter(shapes))
    shapes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] = shapes.pop(name)


def copied(rel: str, to: str):
    def tamper(src: Path, outside: Outside) -> None:
        shutil.copyfile(src / rel, src / to)
    return tamper


def ds_latest(tag: str):
    def tamper(src: Path, outside: Outside) -> None:
        (src / "latest").write_text(tag)
    return tamper


def ds_linked_tag(src: Path, outside: Outside) -> None:
    shutil.rmtree(src / DS_TAG)
    os.symlink(outside.dir, src / DS_TAG)


def tt_payload(src: Path, outside: Outside) -> None:
    """The step folder's DCP ``.metadata`` a pickle whose unpickling would create a file outside."""
    import pickle

    (src / TT_STEP / ".metadata").write_bytes(pickle.dumps(_Payload(outside.dir / "ran")))


def tt_claims(src: Path, outside: Outside) -> None:
    """The ``.metadata`` claiming a 2**20 x 2**20 ``lm_head.weight`` (4 TiB): its data files hold 100 KiB."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(src / TT_STEP)).read_metadata()  # the file written above: trusted here
    metadata.state_dict_metadata["lm_head.weight"].size = torch.Size((2**20, 2**20))
    (src / TT_STEP / ".metadata").write_bytes(pickle.dumps(metadata))


def tt_linked_step(src: Path, outside: Outside) -> None:
    shutil.rmtree(src / TT_STEP)
    os.symlink(outside.dir, src / TT_STEP)


def removed(rel: str):
    def tamper(src: Path, outside: Outside) -> None:
        (src / rel).unlink()
    return tamper


def jobbed(key: str, value: object):
    """torchtitan's job config with the dotted ``key`` set to ``value``."""
    def tamper(src: Path, outside: Outside | None) -> None:
        job = json.loads((src / "job_config.json").read_text())
        section, field = key.split(".")
        job[section][field] = value
        (src / "job_config.json").write_text(json.dumps(job))
    return tamper


NAN, INF = float("nan"), float("inf")
ENV = "${oc.env:HOME}"  # what OmegaConf would resolve to the environment's value, were it written into a recipe


def _id(value: object) -> str:
    return f"int of {value.bit_length()} bits" if type(value) is int and value.bit_length() > 64 else repr(value)[:16]


#: field of training_args.bin -> values out of its type or range
ARGS = {
    "learning_rate": ["1e-3", ENV, NAN, INF, -1.0, True, None, [1e-3], 10**400],
    "warmup_steps": [ENV, NAN, INF, -1, "3", True, [3], 2**62, 1e300, None],
    "warmup_ratio": [NAN, -0.1, 1.5, "0.1", True, ENV],
    "weight_decay": [NAN, -1.0, "0.1", True, ENV],
    "adam_beta1": [1.0, -0.1, NAN, "0.9", 2, ENV],
    "adam_beta2": [1.0, 1.5, NAN, "0.999", None],
    "adam_epsilon": [-1.0, NAN, "1e-8", INF],
    "max_grad_norm": [NAN, -1.0, "1", ENV],
    "num_train_epochs": [NAN, -1.0, "3", INF, 1e300, ENV],
    "max_steps": [-2, NAN, "4", 2**62, 4.5, True, ENV],
    "per_device_train_batch_size": [0, -1, "4", 2**30, NAN, True, ENV],
    "gradient_accumulation_steps": [0, -1, "2", 2**30, NAN, True, ENV],
    "lr_scheduler_type": [ENV, 3, None, ["linear"], "x" * 100, "lin ear", "linear\nx"],
    "lr_scheduler_kwargs": [ENV, 3, [1], {"num_cycles": ENV}, {"num_cycles": NAN}, {"num_cycles": "0.5"},
                            {"min_lr": -1.0}, {"min_lr": ENV}, {"min_lr_rate": 2.0}, {"min_lr_rate": NAN},
                            {"num_cycles": True}],
    "seed": [-1, 2**40, "42", NAN, True, 4.5, ENV, None],
    "data_seed": [-1, "42", ENV],
    "dataloader_drop_last": ["false", 1, ENV],
}
#: field of trainer_state.json -> values out of its type or range
STATE = {"global_step": [-1, "1", 2**41, True, None, ENV], "max_steps": [0, 10**8, "4", None, ENV, 2**62],
         "train_batch_size": [0, "4", 2**30, -4, ENV], "epoch": ["0.25", -1.0, ENV]}
#: the optimizer's param group -> values out of its type or range
GROUP = {"lr": ["1e-3", NAN, -1.0, ENV, None], "betas": [(1.0, 0.999), ("0.9", 0.95), (NAN, 0.9), (0.9, 1.5), (-0.1, 0.9)],
         "eps": [-1.0, "1e-8", NAN], "weight_decay": [NAN, -1.0, "0", ENV], "amsgrad": ["false", 1, None],
         "initial_lr": [NAN, "1e-3", -1.0]}
#: a Lightning scheduler's state -> its arguments out of their types or ranges
SCHEDULERS = {("cosine", "T_max"): [ENV, NAN, 0, -1, 2**62, "4", True], ("cosine", "eta_min"): ["0", NAN, -1.0, ENV],
              ("cosine", "base_lrs"): ["x", [NAN], [], [ENV]], ("linear", "start_factor"): [0.0, 1.5, "0.5", NAN],
              ("linear", "end_factor"): [NAN, -0.5, ENV], ("linear", "total_iters"): ["4", -1, NAN],
              ("step", "step_size"): [0, "2", NAN, ENV], ("step", "gamma"): [NAN, "0.5", -1.0],
              ("one_cycle", "total_steps"): [ENV, 10**8, 0, NAN], ("one_cycle", "cycle_momentum"): ["true", 1]}
#: torchtitan's job config -> values out of their types or ranges
JOB = {"lr_scheduler.warmup_steps": [-1, "2", ENV, 2**62, 1.5], "lr_scheduler.min_lr_factor": [1.5, -0.1, "0.1", ENV],
       "lr_scheduler.decay_type": [ENV, 3, "step"], "lr_scheduler.decay_ratio": [2.0, "0.5", -1.0],
       "lr_scheduler.total_steps": [0, "4", ENV], "training.steps": [0, "4", 2**62, ENV],
       "training.local_batch_size": [0, "4", ENV], "training.global_batch_size": [0, "8", 2**62]}
READS = {
    **{f"training_args.bin {field}={_id(v)}": ("trainer", argued(field, v), ["training_args.bin", field])
       for field, values in ARGS.items() for v in values},
    **{f"trainer_state.json {field}={_id(v)}": ("trainer", stated(field, v), ["trainer_state.json", field])
       for field, values in STATE.items() for v in values},
    **{"scheduler.pt last_epoch=" + _id(v): ("trainer", pickled("scheduler.pt", lambda d, v=v: d.update(last_epoch=v)),
                                            ["scheduler.pt", "last_epoch" if v != 2 else "position"])
       for v in [ENV, NAN, -1, 2, "1", True]},
    **{f"optimizer.pt {field}={_id(v)}": ("trainer", grouped(field, v),
                                          ["optimizer.pt", "beta" if field == "betas" else field])
       for field, values in GROUP.items() for v in values},
    **{f"a Lightning {kind} {field}={_id(v)}": ("ckpt", scheduled_by(kind, field, v), ["last.ckpt", field])
       for (kind, field), values in SCHEDULERS.items() for v in values},
    **{f"torchtitan's {key}={_id(v)}": ("torchtitan", jobbed(key, v), ["job_config.json", key])
       for key, values in JOB.items() for v in values},
}


@pytest.fixture(scope="module")
def limits(sources):
    from automodel_ckpt.cli.import_run import source_limits
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig

    return source_limits(load_config(str(sources["recipe"]), [], RecipeConfig))


@pytest.mark.parametrize("label", READS)
def test_every_value_the_import_reads_is_checked_for_its_type_and_range(sources, limits, tmp_path, label):
    """Each value of the Trainer's arguments and state, of the optimizer's groups and of a scheduler that an import
    reads: a string (one OmegaConf would interpolate included), NaN, an infinity, a bool, a container or a number
    out of its range is refused in one line naming the file and the field, never a traceback."""
    from automodel_ckpt.errors import CheckpointError
    from automodel_ckpt.interop import read_source

    kind, tamper, expected = READS[label]
    src = tmp_path / sources[kind].name
    (shutil.copytree if sources[kind].is_dir() else shutil.copyfile)(sources[kind], src)
    tamper(src, None)
    with pytest.raises(CheckpointError) as refused:
        read_source(src, limits)
    text = str(refused.value)
    assert "\n" not in text and all(e in text for e in expected), text


def test_the_genuine_values_of_each_scheduler_are_read(sources, limits, tmp_path):
    from automodel_ckpt.interop import read_source

    for kind in ("cosine", "linear", "step"):
        src = tmp_path / f"{kind}.ckpt"
        shutil.copyfile(sources["ckpt"], src)
        key, value = next(iter(_scheduler_state(kind).items()))
        scheduled_by(kind, key, value)(src, None)
        assert read_source(src, limits).schedule.target is not None, kind


# label -> (source, tamper, texts of the error line, a large file: memory checked)
LINKS = {
    "trainer_state.json linked outside": ("trainer", link_out("trainer_state.json"), ["trainer_state.json", "symlink"]),
    "scheduler.pt linked outside": ("trainer", link_out("scheduler.pt"), ["scheduler.pt", "symlink"]),
    "rng_state.pth linked outside": ("trainer", link_out("rng_state.pth"), ["rng_state.pth", "symlink"]),
    "optimizer.pt linked inside": ("trainer", link_inside("optimizer.pt"), ["optimizer.pt", "symlink"]),
    "weights through a folder linked outside": ("trainer", linked_folder(False), ["'shards/model.safetensors'",
                                                                                 "symlink"]),
    "weights through a folder linked inside": ("trainer", linked_folder(True), ["symlinked folder 'shards'"]),
    "FSDP model folder linked outside": ("trainer", linked_fsdp_folder, ["pytorch_model_fsdp_0", "symlink"]),
    "meta.pt linked outside": ("folder", link_out("meta.pt"), ["meta.pt", "symlink"]),
    "DCP data file linked outside": ("folder", link_out(SHARD), [SHARD, "symlink"]),
    "DCP data file linked inside": ("folder", link_inside(SHARD), [SHARD, "symlink"]),
}
FIFOS = {
    "trainer_state.json a FIFO": ("trainer", fifo("trainer_state.json"), ["trainer_state.json", "FIFO"]),
    "optimizer.pt a FIFO": ("trainer", fifo("optimizer.pt"), ["optimizer.pt", "FIFO"]),
    "meta.pt a FIFO": ("folder", fifo("meta.pt"), ["meta.pt", "FIFO"]),
    ".metadata a FIFO": ("folder", fifo(".metadata"), [".metadata", "FIFO"]),
}
SIZES = {
    "an 8 GiB .ckpt": ("ckpt", sparse("", HUGE), ["last.ckpt", "8.0 GiB, over the", "recipe's model"]),
    "an 8 GiB DCP data file": ("folder", sparse(SHARD, HUGE), ["its data files", "over the", "recipe's model"]),
    "8 GiB of weights": ("trainer", sparse("model.safetensors", HUGE), ["its weight files", "over the"]),
    "8 GiB of optimizer state": ("trainer", sparse("optimizer.pt", HUGE), ["optimizer.pt", "over the"]),
    "a 200 MiB trainer_state.json": ("trainer", sparse("trainer_state.json", BIG), ["trainer_state.json",
                                                                                   "over the 64.0 MiB"]),
    "a 200 MiB scheduler.pt": ("trainer", sparse("scheduler.pt", BIG), ["scheduler.pt", "over the 1.0 MiB"]),
}
VALUES = {
    "a string for the learning rate": ("trainer", logged("learning_rate", "1e-3"),
                                       ["trainer_state.json", "log_history[0].learning_rate", "not a finite number"]),
    "a NaN loss": ("trainer", logged("loss", float("nan")), ["trainer_state.json", "log_history[0].loss"]),
    "an infinite grad norm": ("trainer", logged("grad_norm", float("inf")), ["log_history[0].grad_norm"]),
    "a list for the grad norm": ("trainer", logged("grad_norm", [1.0, 2.0]), ["log_history[0].grad_norm"]),
    "a string loss": ("trainer", logged("loss", "low"), ["log_history[0].loss"]),
    "an interpolation for the warmup": ("trainer", argued("warmup_steps", ENV), ["training_args.bin", "warmup_steps"]),
    "a NaN warmup": ("trainer", argued("warmup_steps", NAN), ["training_args.bin", "warmup_steps"]),
    "a string learning rate": ("trainer", argued("learning_rate", "1e-3"), ["training_args.bin", "learning_rate"]),
    "an interpolation for the cycles": ("trainer", argued("lr_scheduler_kwargs", {"num_cycles": ENV}),
                                        ["training_args.bin", "lr_scheduler_kwargs.num_cycles"]),
    "a run of 2**40 steps": ("trainer", stated("max_steps", 2**40), ["trainer_state.json", "max_steps"]),
    "no rows a step": ("trainer", stated("train_batch_size", 0), ["trainer_state.json", "train_batch_size"]),
    "a beta of 1.5": ("trainer", grouped("betas", (1.5, 0.999)), ["optimizer.pt", "beta1"]),
    "an interpolation for T_max": ("ckpt", scheduled_by("cosine", "T_max", ENV), ["last.ckpt", "T_max"]),
}
DEEPSPEED = {
    "a DeepSpeed partition that would run code": ("deepspeed", ds_payload, [DS_RANK.format(1).split("/")[1],
                                                                            "names 'builtins.getattr'"]),
    "a DeepSpeed partition linked outside": ("deepspeed", link_out(DS_RANK.format(0)), ["rank_0", "symlink"]),
    "a DeepSpeed tag folder linked outside": ("deepspeed", ds_linked_tag, [DS_TAG, "symlink"]),
    "a DeepSpeed partition a FIFO": ("deepspeed", fifo(DS_RANK.format(1)), ["rank_1", "FIFO"]),
    "an 8 GiB DeepSpeed partition": ("deepspeed", sparse(DS_RANK.format(0), HUGE), ["optimizer partitions", "over"]),
    "8 GiB of DeepSpeed model states": ("deepspeed", sparse(DS_MODEL, HUGE), ["model_states.pt", "over the"]),
    "a DeepSpeed parameter of an oversized shape": ("deepspeed", ds_shape("lm_head.weight", (2**20, 2**20)),
                                                     ["partition sizes do not add up"]),
    "a DeepSpeed rank file missing": ("deepspeed", ds_missing(1), ["a rank file is missing"]),
    "DeepSpeed's rank 0 missing": ("deepspeed", ds_missing(0), ["no rank 0's optimizer partition"]),
    "DeepSpeed's latest naming no folder": ("deepspeed", ds_latest("global_step9"), ["global_step9", "torn"]),
    "DeepSpeed's latest naming a path out": ("deepspeed", ds_latest("../../outside"), ["latest", "not a tag folder"]),
    "a DeepSpeed PEFT run's adapter config linked outside": ("deepspeed-trainer", link_out("adapter_config.json"),
                                                              ["adapter_config.json", "symlink"]),
    "a DeepSpeed run with frozen parameters": ("deepspeed", pickled(DS_MODEL, ds_frozen),
                                                ["model_states.pt", "frozen parameters", "adapter_config.json"]),
    "a bare DeepSpeed engine's LoRA run": ("deepspeed", pickled(DS_MODEL, ds_lora),
                                           ["'model.layers.0.self_attn.q_proj.lora_A.default.weight'",
                                            "adapter_config.json"]),
    "a tensor-parallel DeepSpeed rank": ("deepspeed", copied(DS_RANK.format(0), f"{DS_TAG}/zero_pp_rank_0_mp_rank_01_"
                                                         "optim_states.pt"), ["mp_rank_01", "tensor or pipeline"]),
    "a pipeline-parallel DeepSpeed layer": ("deepspeed", copied(DS_MODEL, f"{DS_TAG}/layer_01-model_00-model_states"
                                                               ".pt"), ["layer_01-model_00", "pipeline parallel"]),
}
TT_SHARD = f"{TT_STEP}/{SHARD}"
TORCHTITAN = {
    "a torchtitan .metadata that would run code": ("torchtitan", tt_payload, [".metadata", "not allowed"]),
    "a torchtitan tensor of an oversized shape": ("torchtitan", tt_claims, ["metadata claims", "data files hold"]),
    "an 8 GiB torchtitan data file": ("torchtitan", sparse(TT_SHARD, HUGE), ["its data files", "over the"]),
    "a torchtitan step folder linked outside": ("torchtitan", tt_linked_step, ["step-1", "symlink"]),
    "a torchtitan data file linked outside": ("torchtitan", link_out(TT_SHARD), [SHARD, "symlink"]),
    "a torchtitan job config linked outside": ("torchtitan", link_out("job_config.json"), ["job_config.json",
                                                                                           "symlink"]),
    "a torn torchtitan step folder": ("torchtitan", removed(f"{TT_STEP}/.metadata"), ["no complete step-N/"]),
    "a torchtitan data file missing": ("torchtitan", removed(TT_SHARD), [SHARD, "missing"]),
    "a torchtitan run without its job config": ("torchtitan", removed("job_config.json"),
                                                ["lr_scheduler", "--debug.save_config_file"]),
}
CASES = {**LINKS, **FIFOS, **SIZES, **VALUES, **DEEPSPEED, **TORCHTITAN}


@pytest.fixture
def import_case(server, assets, sources, tmp_path):
    made: list[Case] = []

    def make(kind: str) -> tuple[Case, Path]:
        case = Case(server, assets, tmp_path / "work", Outside(tmp_path / "outside"))
        case.work.mkdir()
        made.append(case)
        src = case.work / sources[kind].name
        (shutil.copytree if sources[kind].is_dir() else shutil.copyfile)(sources[kind], src)
        return case, src

    yield make
    for case in made:
        case.outside.close()


@pytest.mark.parametrize("label", CASES)
def test_a_hostile_source_is_refused_in_one_line_before_anything_is_built(import_case, sources, label):
    kind, tamper, expected = CASES[label]
    case, src = import_case(kind)
    tamper(src, case.outside)
    outcome = case.verb("import", src, sources["recipe"], "--out", case.work / "run", timeout=FIFO_TIMEOUT)
    refused(outcome, *expected)
    if label in SIZES:
        lean(outcome, case.server.rss)
    assert not (case.work / "run").exists(), f"a run folder was written:\n{outcome}"
