"""The HF Trainer and Lightning on a tiny recipe's own rows, for the import and export tests (in this process, CPU)."""

from __future__ import annotations

from pathlib import Path

RECIPE = """\
seed: 42
model:
  _target_: automodel_ckpt.models.build.build_causal_lm
  pretrained_model_name_or_path: {model}
  embedded: tiny_llama
  dtype: float32
dataset:
  _target_: automodel_ckpt.data.builtin.builtin_task_dataset
  num_samples: 200
  seed: 1234
data:
  seq_length: 16
  val_size: 0
  shuffle: false
step_scheduler:
  global_batch_size: 8
  local_batch_size: 8
  num_epochs: 3
  max_steps: 10
  ckpt_every_steps: 100
optimizer:
  _target_: torch.optim.AdamW
  lr: 3.0e-3
  weight_decay: 0.0
  betas: [0.9, 0.95]
lr_scheduler: {schedule}
training:
  max_grad_norm: 1.0
  log_sample_ids: true
  progress_bar: false
checkpoint:
  enabled: true
  checkpoint_dir: checkpoints/
  save_consolidated: false
"""
HF_LINEAR = "{_target_: automodel_ckpt.training.lr.linear_decay, warmup_steps: 2}"
COSINE_ANNEALING = "{_target_: automodel_ckpt.training.lr.cosine_annealing, t_max: 10}"
# torch's OneCycleLR(max_lr, total_steps=10): lr from max_lr / 25 up to max_lr by step 2, then down to / 1e4 by
# step 9; beta1 from 0.95 down to 0.85 and back
ONE_CYCLE = ("{_target_: automodel_ckpt.training.lr.one_cycle, ends: [2.0, 9.0], factors: [1.0, 25.0, 0.0001], "
             "anneal: cos, momenta: [0.95, 0.85, 0.95]}")
LORA = "peft: {method: lora, rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj]}\n"
BATCH, STEPS, SAVED_AT = 8, 10, 6


DECAY = 0.1  # the weight decay of the runs with the HF Trainer's groups (biases and norms without)


def write_recipe(folder: Path, assets: Path, schedule: str, *, lora: bool = False, decay: bool = False) -> Path:
    """The recipe; ``decay``: its optimizer is ``AdamWNoDecay`` with weight decay ``DECAY``."""
    path = folder / "recipe.yaml"
    text = RECIPE.format(model=assets / "tiny_llama_base", schedule=schedule)
    if decay:
        text = text.replace("  _target_: torch.optim.AdamW\n  lr: 3.0e-3\n  weight_decay: 0.0\n",
                            f"  _target_: automodel_ckpt.training.decay.AdamWNoDecay\n  lr: 3.0e-3\n"
                            f"  weight_decay: {DECAY}\n")
        assert "AdamWNoDecay" in text
    path.write_text(text + (LORA if lora else ""))
    return path


def recipe_rows(recipe: Path) -> list[dict]:
    """The recipe's training rows as the model sees them (input ids, labels, attention mask), in order."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data.pipeline import prepare_data
    from automodel_ckpt.models.build import build_tokenizer

    cfg = load_config(str(recipe), [], RecipeConfig)
    data = prepare_data(cfg, build_tokenizer(cfg.model.pretrained_model_name_or_path)).train
    keys = ("input_ids", "labels", "attention_mask")
    return [{k: v[0] for k, v in data.batch([i]).items() if k in keys} for i in range(len(data))]


def assert_imported_as_theirs(weights: dict, state: dict, theirs: dict, step: int) -> None:
    """The imported checkpoint's weights and optimizer ``state`` (by parameter name) are the source's own reading
    (``theirs``: ``weights``, ``exp_avg``, ``exp_avg_sq`` by name), bit for bit, each parameter at ``step``."""
    import torch

    assert sorted(weights) == sorted(theirs["weights"]) == sorted(state)
    for name, tensor in theirs["weights"].items():
        assert torch.equal(weights[name], tensor), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][moment], theirs[moment][name]), (name, moment)
        assert float(state[name]["step"]) == step


def source_model(assets: Path, lora: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets / "tiny_llama_base", dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model


class LossTrainer:
    """An HF ``Trainer`` (sequential sampler, the recipe's hyperparameters; ``accumulation`` micro-batches of
    ``BATCH // accumulation`` rows a step; its two groups, biases and norms without ``weight_decay``) recording
    each step's loss."""

    def __init__(self, out: Path, rows: list[dict], assets: Path, *, lora: bool = False, schedule: str = "linear",
                 accumulation: int = 1, weight_decay: float = 0.0):
        from transformers import Trainer, TrainingArguments, default_data_collator

        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=BATCH // accumulation,
            gradient_accumulation_steps=accumulation, max_steps=STEPS, save_steps=SAVED_AT,
            save_strategy="steps", learning_rate=3e-3, lr_scheduler_type=schedule, warmup_steps=2,
            weight_decay=weight_decay,
            adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1, train_sampling_strategy="sequential", report_to=[],
            use_cpu=True, seed=42, disable_tqdm=True, save_only_model=False)
        self.trainer = Trainer(model=source_model(assets, lora), args=args, train_dataset=rows,
                               data_collator=default_data_collator)

    def train(self, resume: Path | None = None) -> dict[int, float]:
        self.trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        return {h["step"]: h["loss"] for h in self.trainer.state.log_history if "loss" in h}


def lightning_fit(rows: list[dict], assets: Path, steps: int, save: Path, *, sharded: bool = False
                  ) -> dict[int, float]:
    """Lightning on a plain ``DataLoader(shuffle=False)``, CosineAnnealingLR per step, its checkpoint callback
    writing ``save/six.ckpt`` after step 6; each step's loss. ``sharded``: OneCycleLR (its beta1 cycled) per step,
    under ``ModelParallelStrategy`` on 2 processes (FSDP2 on each decoder layer, CPU, gloo), whose ``six.ckpt`` is a
    distributed checkpoint folder (``.metadata``, one ``*.distcp`` per rank, ``meta.pt``). Both processes read the
    same plain loader (``use_distributed_sampler=False``): the gradient averaged over them is each one's, so the
    run is the 1-process run of 8 rows a step, written by two ranks. Lightning relaunches the script for rank 1,
    so it runs as a command of its own (``main`` below)."""
    import lightning as L
    import torch
    from transformers import default_data_collator

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = source_model(assets, False)
            self.losses: dict[int, float] = {}

        def configure_model(self) -> None:
            if sharded:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, index):
            loss = self.model(**batch).loss
            self.losses[self.global_step + 1] = loss.item()
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
            schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS) if sharded else \
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    module = Module()
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False, collate_fn=default_data_collator)
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=str(save), filename="six", every_n_train_steps=SAVED_AT, save_top_k=-1)
    strategy: object = "auto"
    if sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    # a distributed strategy's own sampler shuffles the training rows and splits them: each process keeps the
    # loader's order
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=2 if sharded else 1, callbacks=[every],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        strategy=strategy, use_distributed_sampler=False)
    trainer.fit(module, loader)
    return module.losses


def main(argv: list[str]) -> None:
    """``python -m tests.integration.foreign_trainers lightning-sharded RECIPE ASSETS SAVE``: ``lightning_fit``
    sharded, its losses written to ``SAVE/losses.json``."""
    import json

    kind, recipe, assets, save = argv
    assert kind == "lightning-sharded", kind
    losses = lightning_fit(recipe_rows(Path(recipe)), Path(assets), STEPS, Path(save), sharded=True)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (Path(save) / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
