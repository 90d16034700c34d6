"""Supervised fine-tuning of a Hugging Face causal LM with FSDP2, resumable at every checkpoint."""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import OmegaConf

from automodel_ckpt.algorithms.base import Algorithm
from automodel_ckpt.algorithms.context import Forward, Run, TrainContext
from automodel_ckpt.algorithms.sft.algorithm import Supervised
from automodel_ckpt.checkpoint import HFArtifacts, discover_state, run_folder, written_by
from automodel_ckpt.ondisk import RunFolder, run_fingerprint
from automodel_ckpt.config.instantiate import instantiate, locate
from automodel_ckpt.data import BatchLoader, MicroBatch
from automodel_ckpt.distributed.activation_checkpoint import checkpoint_blocks
from automodel_ckpt.distributed.collective import main_first
from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.allocator import keep_freed_memory
from automodel_ckpt.distributed.mesh import build_parallel_dims, resolve_sizes
from automodel_ckpt.distributed.pipeline import (Pipeline, check_pipeline_model, cut_stage, describe_layers,
                                                 tied_embeddings)
from automodel_ckpt.distributed.tensor_parallel import clip_grad_norm
from automodel_ckpt.errors import TrainingError
from automodel_ckpt.models.build import build_tokenizer, local_model_path
from automodel_ckpt.models.freeze import apply_freeze, parameter_line
from automodel_ckpt.models.lora import apply_lora, lora_summary
from automodel_ckpt.models.materialize import StartingWeights, builds_on_meta
from automodel_ckpt.recipes.base import BaseRecipe
from automodel_ckpt.recipes.stages import StageRun
from automodel_ckpt.training import compile
from automodel_ckpt.training.ema import EMA
from automodel_ckpt.evaluation.during_training import InTrainingEval
from automodel_ckpt.training.metrics import JsonlLog
from automodel_ckpt.training.optimizer import implementation
from automodel_ckpt.training.progress import Progress
from automodel_ckpt.training.rng import RNGState, rng_untouched
from automodel_ckpt.training.step_scheduler import StepScheduler


class FinetuneRecipe(BaseRecipe):
    """``setup`` builds everything from the config; ``train`` trains, validates and checkpoints. Checkpointed state
    is discovered from the attributes: model, optimizer, schedules, dataloader, rng, the algorithm's public state."""

    #: What is trained, and how (``algorithms/``); a subclass names another (``DPORecipe``).
    algorithm_class: ClassVar[type[Algorithm]] = Supervised
    #: An image-text model's processor (``VLMFinetuneRecipe``), saved beside the weights in place of the tokenizer.
    processor: Any = None
    pipeline: Any = None  # this rank's pipeline stage, with ``distributed.pp_size`` > 1
    data_parallel: Any = None  # how the data-parallel ranks hold the model (``distributed.data_parallel.Choice``)
    dataloader: BatchLoader  # the algorithm's training batches
    #: The moving average of the trainable weights, with ``training.ema_decay`` (checkpointed as ``ema``).
    ema: EMA | None = None
    takes_stages = True  # a run in stages (docs/stages.md): ``recipes.stages.StageRun`` is this recipe's
    _evaluation: InTrainingEval | None = None  # the ``evaluation:`` section's tasks (set in ``setup``)
    _eval_scores: dict[str, float] | None = None  # the scores of the step just taken, when it evaluated
    _step_metrics: dict[str, Any] = {}  # the algorithm's numbers of the step just taken

    @functools.cached_property
    def algorithm(self) -> Algorithm:
        """``algorithm_class`` on a ``TrainContext``, which ``setup`` fills as it builds the run."""
        run = Run(self.checkpoint_config, say=lambda line: self.progress.write(line),
                  fence=lambda: self.checkpointer.fence())
        return self.algorithm_class(TrainContext(self.cfg, run))

    @functools.cached_property
    def _stage_run(self) -> StageRun:
        """This launch's stages (``_stage_of``: the plan and the stage it is built for)."""
        return StageRun(self.cfg, *getattr(self, "_stage_of", ()))

    # ---------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """The run, built in order (the model on the meta device: its weights come at the restore)."""
        cfg, algorithm = self.cfg, self.algorithm  # the algorithm first: its config is checked before any build
        self.setup_distributed()
        # who is who: data-parallel and tensor-parallel ranks (everything per rank below is per data-parallel rank)
        self.dims = build_parallel_dims(resolve_sizes(cfg.distributed, self.env.world_size), self.env.rank,
                                        self.env.device.type)
        model, fingerprint = self._build_model()
        plan, tied = self._cut_stage(model)
        self._shard(self._compiled(model), plan, tied)
        with rng_untouched():  # the training batches and this rank's validation batches
            self.dataloader, self.val_batches, self.data_report = algorithm.build_loader()
        optimizer_line = self._build_optimizer()
        self._build_logs(optimizer_line)
        self.build_checkpointer(hf=self.hf_artifacts(), say=self.progress.write, fingerprint=fingerprint,
                                dims=self.dims, stages=self._stage_run.rule if self._stage_run.active else None)
        algorithm.build()

    def _build_model(self) -> tuple[torch.nn.Module, str]:
        """The model and tokenizer, LoRA, frozen parameters, activation checkpointing; the run's fingerprint."""
        cfg = self.cfg
        # One-time work draws no number from the training stream, so a seed gives the same run on every rank.
        # Built on the meta device; the weights are filled once restore_checkpoint knows whether a checkpoint does.
        self.starting_weights = StartingWeights(cfg.model, self.env.rank,
                                               build_whole=lambda: instantiate(cfg.model, "model"))
        with rng_untouched():
            self.tokenizer, model = self.build_model_and_tokenizer()
        if cfg.peft is not None:  # LoRA: wrap before sharding, so FSDP2 sees frozen base and trainable adapters
            with self.starting_weights.kept_parameters():
                model = apply_lora(model, cfg.peft)
            if self.env.is_main:
                print(lora_summary(model), flush=True)
        frozen = cfg.model.get("freeze")  # model.freeze: no gradients, no optimizer state (after LoRA: it composes)
        apply_freeze(model, frozen)
        if self.env.is_main:
            print(parameter_line(model, frozen), flush=True)
        fingerprint = run_fingerprint(model, self.tokenizer, self._peft_section(), self.state_meaning())
        self._stage_run.built(model, fingerprint, lambda staged: run_fingerprint(
            model, recipe=self.state_meaning(staged))["recipe"])  # each stage's, and its seq_length checked
        if cfg.distributed.activation_checkpointing:  # per block, before sharding; parameter names unchanged
            blocks = checkpoint_blocks(model)
            if self.env.is_main:
                print(f"Activation checkpointing: {blocks} blocks recompute their activations in backward", flush=True)
        return model, fingerprint

    def _cut_stage(self, model: torch.nn.Module) -> tuple[Any, bool]:
        """This rank's pipeline stage, cut on the meta device: the plan, and whether a tied weight spans stages."""
        if self.dims.pp_size <= 1:
            return None, False
        cfg = self.cfg
        plan = check_pipeline_model(model, cfg.distributed, self.dims.sizes, cfg.step_scheduler.local_batch_size)
        tied = tied_embeddings(model)
        layers = cut_stage(model, plan, self.dims.pp_rank, self.dims.pp_size)
        if self.dims.dp_rank == 0 and self.dims.tp_rank == 0:
            print(f"Pipeline stage {self.dims.pp_rank}: {describe_layers(layers)} ({plan.describe()})", flush=True)
        return plan, tied

    def _compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """``training.compile``: each block compiled in place when it pays, before sharding (torchtitan's order)."""
        sched = self.cfg.step_scheduler
        tokens = sched.global_batch_size * self.cfg.data.seq_length // self.dims.dp_size  # a process's, each step
        work = compile.step_flop(sum(p.numel() for p in model.parameters()), tokens)
        compiled, self._compile_line = compile.decide(self.cfg.training.compile, self.env.device, work, sched.max_steps)
        if compiled:
            compile.compile_blocks(model)
        return model

    def _shard(self, model: torch.nn.Module, plan: Any, tied: bool) -> None:
        """The model held by the data-parallel ranks (sharded or replicated), materialised; its pipeline."""
        cfg = self.cfg
        self.data_parallel = data_parallel.choose(cfg.distributed.dp_shard, self.dims, model, self.env.device,
                                                  cfg.distributed.mixed_precision)
        self.model = data_parallel.wrap(model, self.data_parallel, self.dims)
        if not self.data_parallel.sharded:  # a model that fits with room: freed blocks kept for the next step
            keep_freed_memory()
        self.starting_weights.materialize(self.model, self.env.device)
        algorithm = self.algorithm
        forward = Forward(self.model, self.env.device, self.data_parallel, algorithm.compute_loss, plan,
                          rows=algorithm.pipeline_rows)
        self.pipeline = forward.pipeline = (
            Pipeline(self.model, self.dims, plan, self.env.device, forward.staged_loss,
                     rows=cfg.step_scheduler.local_batch_size, tied=tied) if plan is not None else None)
        ctx = algorithm.ctx  # what the algorithm reads of the run, now built
        ctx.env, ctx.dims, ctx.model, ctx.forward = self.env, self.dims, self.model, forward
        ctx.tokenizer, ctx.processor = self.tokenizer, self.processor

    def _build_optimizer(self) -> str:
        """The step scheduler, optimizer, lr schedule, RNG state, EMA and evaluation; returns the optimizer's line."""
        cfg, sched = self.cfg, self.cfg.step_scheduler
        self.step_scheduler = StepScheduler(
            max_steps=sched.max_steps, num_epochs=sched.num_epochs, ckpt_every_steps=sched.ckpt_every_steps,
            val_every_steps=sched.val_every_steps, steps_per_epoch=self.dataloader.steps_per_epoch,
            min_every_steps=sched.min_every_steps, max_every_steps=sched.max_every_steps)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        chosen, optimizer_line = implementation(locate(cfg.optimizer.get("_target_"), "optimizer._target_"),
                                                cfg.optimizer, trainable)
        self.optimizer = instantiate(cfg.optimizer, "optimizer", trainable, **chosen)
        self.lr_scheduler = instantiate(cfg.lr_scheduler, "lr_scheduler", self.optimizer,
                                        total_steps=self.step_scheduler.total_steps)
        self.rng = RNGState()
        if cfg.training.get("ema_decay") is not None:  # float32, sharded like the parameters; filled at the restore
            self.ema = EMA(self.model, cfg.training.ema_decay)
        if cfg.get("evaluation") is not None and cfg.evaluation.every_steps is not None:
            self._evaluation = InTrainingEval(cfg.evaluation, is_main=self.env.is_main, pp_size=self.dims.pp_size,
                                              peft=cfg.peft is not None)
        return optimizer_line

    def _build_logs(self, optimizer_line: str) -> None:
        """training.jsonl, validation.jsonl and the progress bar; the setup's report lines."""
        run_dir = run_folder(self.checkpoint_config)  # checkpoint_dir, or the local mirror of an object-store URL
        self.train_log = JsonlLog(RunFolder(run_dir).training_log, enabled=self.env.is_main)
        self.val_log = JsonlLog(RunFolder(run_dir).validation_log, enabled=self.env.is_main)
        self.progress = Progress(self.step_scheduler.total_steps,
                                 enabled=self.env.is_main and self.cfg.training.progress_bar)
        if self.env.is_main:
            for line in (self.data_report, self.data_parallel.describe(), optimizer_line, self._compile_line):
                self.progress.write(line)

    def build_model_and_tokenizer(self) -> tuple[Any, torch.nn.Module]:
        """Rank 0 builds first (an embedded base is created once); another package's model is moved to the device."""
        meta = builds_on_meta(self.cfg.model)
        model = main_first(lambda: instantiate(self.cfg.model, "model", **({"on_meta": True} if meta else {})),
                           self.env.rank)
        tok_path = self.cfg.tokenizer.pretrained_model_name_or_path or self.cfg.model.get("pretrained_model_name_or_path")
        return self.load_tokenizer(tok_path), model if meta else model.to(self.env.device)

    def restore_checkpoint(self) -> Path | None:
        """The restore, then the starting weights of whatever it did not fill, then the algorithm's state."""
        self._stage_run.hold(self)  # a run in stages: the schedule's state loaded once a stage's start is known
        restored = super().restore_checkpoint()
        self.starting_weights.fill(self.model, model_loaded="model" in self.restored.states)
        if self.ema is not None and "ema" not in self.restored.states:  # a fresh run, or a checkpoint without it
            self.ema.start(self.model)
        self.algorithm.restored(self.restored.states)
        self._stage_run.restored(self)  # a stage that begins at the next step begins
        return restored

    def checkpointed_state(self) -> dict[str, Any]:
        """The recipe's discovered state and the algorithm's (less its ``checkpoint_exclude``)."""
        algorithm = self.algorithm
        return super().checkpointed_state() | discover_state(algorithm, exclude=algorithm.checkpoint_exclude)

    def load_tokenizer(self, path: str | None) -> Any:
        """The tokenizer of the folder ``path`` (``tokenizer.pretrained_model_name_or_path``, else the model's)."""
        return build_tokenizer(path)

    def state_meaning(self, cfg: Any = None) -> dict[str, Any]:
        """The recipe keys that change what saved state means (the fingerprint's), of this or ``cfg``'s stage."""
        cfg = self.cfg if cfg is None else cfg
        meaning = {"dataset": OmegaConf.to_container(cfg.dataset, resolve=True), "data.seq_length": cfg.data.seq_length,
                   "step_scheduler.global_batch_size": cfg.step_scheduler.global_batch_size}
        if cfg.model.get("freeze"):  # what trains is what the optimizer's state covers
            meaning["model.freeze"] = OmegaConf.to_container(cfg.model, resolve=True)["freeze"]
        return meaning | dict(self.algorithm.state_meaning)

    def _peft_section(self) -> dict[str, Any] | None:
        return OmegaConf.to_container(self.cfg.peft, resolve=True) if self.cfg.peft is not None else None

    def hf_artifacts(self) -> HFArtifacts:
        model = self.model
        return HFArtifacts(hf_config=getattr(model, "config", None),
                           generation_config=getattr(model, "generation_config", None),
                           tokenizer=self.processor if self.processor is not None else self.tokenizer,
                           base_model_path=local_model_path(self.cfg.model.get("pretrained_model_name_or_path")),
                           peft=self._peft_section())

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> Any:
        """From the restored step to the end, or until preempted; returns the last ``StepEnded``."""
        sched = self.step_scheduler
        # lines past the restored step are from a run that died before its next checkpoint: logged again
        self.train_log.truncate_after(sched.step)
        self.val_log.truncate_after(sched.step)
        if self.restored.path is not None:
            self.report_world_size_change(self.restored.path)
        self.progress.start(sched.step)
        ended = None
        while not sched.done:
            t0 = time.perf_counter()
            epoch, micro = self.dataloader.next_batch()
            fetched = time.perf_counter() - t0
            loss, grad_norm, tokens = self.train_step(micro)
            refuse_non_finite(sched.step + 1, loss, grad_norm)  # before anything of that step is kept or saved
            if self.ema is not None:
                self.checkpointer.fence()  # an async save's copy of the average taken first
                self.ema.update(self.model)
            lr = self.optimizer.param_groups[0]["lr"]
            self.lr_scheduler.step()
            sched.record_step(epoch, self.dataloader.global_batch_size)
            seconds = max(time.perf_counter() - t0, 1e-9)  # the batch fetched, the optimizer step taken
            record = {"step": sched.step, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_sec": tokens / seconds, "step_seconds": round(seconds, 6)} | self._step_metrics
            if self.cfg.training.log_sample_ids:
                record["sample_ids"] = self.dataloader.last_sample_ids
            record |= self.dataloader.report(fetched)  # a streamed corpus: tokens per source, the wait, bad rows
            record |= self._stage_run.step(tokens, self._observer)  # a run in stages: the step's stage
            self.train_log.append(record)
            per_source = {f"source_{i}_tokens": t for i, t in enumerate(record.get("source_tokens", []))}
            self._observer.log_train(record | per_source | {"consumed_samples": sched.consumed_samples}
                                     | self._stage_run.tracked())
            shown = {k: record[k] for k in self.algorithm.bar_metrics if k in record}
            self.progress.update(sched.step, loss, lr, shown)
            self._eval_scores = self._evaluate_and_log() if self._evaluation and self._evaluation.due(sched.step) \
                else None  # before the step's save: its checkpoint records the scores (checkpoint.monitor)
            # what to save now, saved (a durable checkpoint, validated first when scheduled, or a node-local step)
            ended = self.checkpointer.step_end(self.checkpointed_state, sched, epoch=epoch, loss=loss,
                                               extra=self._save_extra, validate=self._validate_and_log,
                                               validate_now=sched.is_val_step)
            if ended.stop or sched.stage_ends:  # preempted, or this launch's stage ends (saved)
                break
        self.progress.close()
        return ended

    def _validate_and_log(self) -> float | None:
        """Validate (when there is held-out data) and log it: validation.jsonl and the trackers."""
        if self.val_batches is None:
            return None
        validated = self.algorithm.validate(self.val_batches)
        val_record = {"step": self.step_scheduler.step, "val_loss": validated.loss} | validated.metrics
        self.val_log.append(val_record)
        self._observer.log_validation(val_record)
        return validated.loss

    def _evaluate_and_log(self) -> dict[str, float]:
        """The ``evaluation:`` tasks on the current weights (rank 0; collective), logged like validation."""
        scores = self._evaluation.run(self.model, self.tokenizer)
        step = self.step_scheduler.step
        self.val_log.append({"step": step} | scores)
        self._observer.tracker.log(scores, step)
        if self.env.is_main:
            self.progress.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
        return scores

    def _save_extra(self) -> dict[str, Any]:
        """What a checkpoint's metadata records besides the step: samples consumed, a stream's data position."""
        extra: dict[str, Any] = {"consumed_samples": self.step_scheduler.consumed_samples}
        position = self.dataloader.summary()  # a stream's: where each source is
        if position is not None:
            extra["data_position"] = position
        if self._eval_scores:  # the step's evaluation: rankable by checkpoint.monitor (eval/<task>/<metric>)
            extra["val_metrics"] = dict(self._eval_scores)
        return extra | self.algorithm.save_extra() | self._stage_run.extra()  # the algorithm's counters, the stages

    def report_world_size_change(self, checkpoint: Path) -> None:
        """Say what changed when a checkpoint written on one mesh (W processes) resumes on another."""
        written = written_by(checkpoint)
        now = self.dims.sizes
        same_mesh = written.mesh is None or written.mesh.record() == now.record()
        if (written.world_size == self.env.world_size and same_mesh) or not self.env.is_main:
            return
        sched = self.cfg.step_scheduler
        saved_local = written.local_batch_size or sched.local_batch_size
        saved_dp = written.mesh.dp if written.mesh is not None else written.world_size
        before = sched.global_batch_size // max(saved_local * saved_dp, 1)
        kept = (f"global batch {sched.global_batch_size} kept, gradient accumulation {before} -> "
                f"{self.dataloader.grad_accum}; model and optimizer resharded, data position kept")
        if same_mesh or (written.mesh.one_dimensional and now.one_dimensional):
            self.progress.write(f"Resuming at world size {self.env.world_size} (checkpoint written by "
                                f"{written.world_size}): {kept}")
        else:  # another strategy: one line that says which
            resized = (f" (world size {written.world_size} -> {self.env.world_size})"
                       if written.world_size != self.env.world_size else "")
            self.progress.write(f"Resuming a {written.mesh.describe()} checkpoint on {now.describe()}{resized}: {kept}")

    def train_step(self, micro: list[MicroBatch]) -> tuple[float, float, float]:
        """One optimizer step over the global batch; returns (global mean loss, grad norm, tokens).

        The loss is the mean over what ``loss_count`` counts in the global batch, whatever the mesh: each rank
        scales its summed losses by ``dp_size / global_count`` because FSDP averages gradients over the
        data-parallel ranks (tensor-parallel peers compute the same loss on the same rows). An algorithm changes
        the loss, never the step."""
        algorithm, forward = self.algorithm, self.algorithm.ctx.forward
        self.model.train()
        counts = torch.stack([sum(algorithm.loss_count(mb) for mb in micro),
                              sum(mb.attention_mask.sum() for mb in micro)])
        global_count, input_tokens = self.dims.sum_over_dp(counts).tolist()
        scale = self.dims.dp_size / max(global_count, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        sums: list[torch.Tensor | None] = []  # each loss call's metric sums
        for i, mb in enumerate(micro):
            # sharded: reduce-scattered after each backward; the all-reduce of HSDP or a replica waits for the last
            data_parallel.sync_gradients(self.model, i == len(micro) - 1)
            if self.pipeline is not None:  # every stage: the last one's summed loss, zero on the others
                input_ids, target, extra = forward.staged(mb, algorithm.loss_target(mb))
                loss_sum += self.pipeline.step(input_ids, target, extra, scale).to(loss_sum.device)
                sums += forward.staged_sums()
                continue
            result = forward.batch_loss(mb, algorithm.loss_target(mb))  # its target first (a reference's forward)
            (result.loss * scale).backward()
            loss_sum += result.loss.detach()
            sums.append(result.sums)
        # a tied embedding's two stages: gradients summed, counted once in the norm
        uncounted = self.pipeline.share_tied_gradients() if self.pipeline is not None else []
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.max_grad_norm, self.dims.pp_group,
                                   uncounted)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the step's one wait for the device: the logged numbers copied to the host together
        loss_sum, grad_norm = torch.stack([loss_sum, grad_norm.to(loss_sum)]).cpu().unbind()
        loss = (self.dims.sum_over_stages(self.dims.sum_over_dp(loss_sum)) / max(global_count, 1.0)).item()
        done = algorithm.step_done(loss, global_count, sums)
        self._step_metrics = done.metrics
        return done.loss, grad_norm.item(), input_tokens


def refuse_non_finite(step: int, loss: float, grad_norm: float) -> None:
    """A non-finite loss or gradient norm (the same on every rank) stops the run before the step is saved."""
    for name, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise TrainingError(f"step {step}: the {name} is {value}, not a finite number; the run stops before "
                                "saving the weights it reached (resume from the last checkpoint, with a lower "
                                "optimizer.lr or other data)")
