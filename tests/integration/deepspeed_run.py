"""A real DeepSpeed ZeRO run of the tiny Llama on CPU (gloo), for the import tests: each rank of a torchrun job.

``python -m tests.integration.forked_ranks 2 tests/integration/deepspeed_run.py STAGE RECIPE ASSETS OUT`` (or
``torchrun --nproc-per-node 2``)
trains ``STEPS`` steps of ``deepspeed.initialize``'s engine (fp32, ZeRO ``STAGE``, DeepSpeed's own AdamW and
scheduler from its config) on the recipe's rows in order, each rank taking its half of each step's batch, saves the
engine's checkpoint after step ``SAVED_AT`` into ``OUT/ds`` (``latest``, ``global_step6/``), and writes
``OUT/reference.json`` (each step's loss over its tokens, and lr) and ``OUT/logits.pt`` (the engine's logits at
step 6 on ``interop.check.probe_inputs``). ``STAGE`` ``trainer`` (``trainer-lora``: its LoRA run): the HF Trainer
with ``deepspeed=`` (ZeRO-2) in place of the bare engine (``trainer_main``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BATCH, STEPS, SAVED_AT = 12, 10, 6
LR = 3e-3
SCHEDULERS = {  # DeepSpeed's schedulers, by the stage they are run with
    2: {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 2,
                                            "total_num_steps": STEPS, "warmup_type": "linear"}},
    3: {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_num_steps": 2,
                                             "total_num_steps": STEPS, "warmup_type": "linear"}},
}


def config(stage: int, world: int) -> dict:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world,
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.0, "torch_adam": True}},
            "scheduler": SCHEDULERS[stage], "zero_optimization": {"stage": stage}}


def trainer_main(recipe: Path, assets: Path, out: Path, lora: bool = False) -> None:
    """The HF Trainer with ``deepspeed=`` a ZeRO-2 config (its own AdamW with its two groups, weight decay but for
    biases and norms, and its linear schedule with 2 warmup steps; the rows in order, each rank its half of a step),
    saving ``OUT/trainer/checkpoint-6/`` (``global_step6/``, ``latest``, its state, scheduler and generators); then a
    second Trainer resumed from it to step 10, whose losses and lr at steps 7-10 are ``reference.json``'s.
    ``lora``: a PEFT LoRA model (``trainer-lora``), which the Trainer saves without its frozen base."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from automodel_ckpt.interop.check import probe_inputs
    from tests.integration.foreign_trainers import DECAY, recipe_rows, source_model

    rows = recipe_rows(recipe)
    zero2 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
             "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}, "steps_per_print": 10**6}

    class Logits(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == SAVED_AT:
                with torch.no_grad():
                    logits = model(input_ids=probe_inputs(model.config.vocab_size)).logits
                if state.is_world_process_zero:
                    torch.save(logits.float(), out / "logits.pt")

    def trainer(folder: str) -> Trainer:
        args = TrainingArguments(
            output_dir=str(out / folder), per_device_train_batch_size=BATCH // 2, max_steps=STEPS,
            save_steps=SAVED_AT, save_strategy="steps", learning_rate=LR, lr_scheduler_type="linear", warmup_steps=2,
            weight_decay=DECAY, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1, report_to=[], seed=42,
            train_sampling_strategy="sequential", disable_tqdm=True, deepspeed=zero2, use_cpu=True)
        torch.manual_seed(0)  # a LoRA adapter's initial values, the same in every run
        return Trainer(model=source_model(assets, lora), args=args, train_dataset=rows,
                       data_collator=default_data_collator, callbacks=[Logits()])

    trainer("trainer").train()
    again = trainer("again")
    again.train(resume_from_checkpoint=str(out / "trainer" / f"checkpoint-{SAVED_AT}"))
    logged = [h for h in again.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        (out / "reference.json").write_text(json.dumps({"loss": {h["step"]: h["loss"] for h in logged},
                                                        "lr": {h["step"]: h["learning_rate"] for h in logged}}))
    dist.barrier()
    dist.destroy_process_group()  # else a rank may abort at exit, a communication thread still running


def main(argv: list[str]) -> None:
    if argv[0] in ("trainer", "trainer-lora"):
        trainer_main(Path(argv[1]), Path(argv[2]), Path(argv[3]), lora=argv[0] == "trainer-lora")
        return
    stage, recipe, assets, out = int(argv[0]), Path(argv[1]), Path(argv[2]), Path(argv[3])
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, default_data_collator

    from automodel_ckpt.interop.check import probe_inputs
    from tests.integration.foreign_trainers import recipe_rows

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    rows = recipe_rows(recipe)
    model = AutoModelForCausalLM.from_pretrained(assets / "tiny_llama_base", dtype=torch.float32)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, world))
    micro = BATCH // world
    record: dict[str, dict[int, float]] = {"loss": {}, "lr": {}}
    for step in range(1, STEPS + 1):
        first = (step - 1) * BATCH + rank * micro
        batch = default_data_collator(rows[first:first + micro])
        record["lr"][step] = engine.get_lr()[0]
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        # the loss over the step's tokens, as ours reports it (DeepSpeed's gradient is the mean of each rank's:
        # the same where the ranks hold as many tokens, as at steps 7 to 9 here)
        tokens = (batch["labels"][:, 1:] != -100).sum()
        weighed = torch.stack([loss.detach() * tokens, tokens.float()])
        dist.all_reduce(weighed)
        record["loss"][step] = (weighed[0] / weighed[1]).item()
        if step == SAVED_AT:
            engine.save_checkpoint(str(out / "ds"))
            with torch.no_grad():
                logits = engine(input_ids=probe_inputs(model.config.vocab_size)).logits
            if rank == 0:
                torch.save(logits.float().cpu(), out / "logits.pt")
    if rank == 0:
        (out / "reference.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
