"""Preference tuning (DPO, IPO, hinge, SimPO) as an algorithm: pairs, a pair loss, a reference and counters."""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from automodel_ckpt.algorithms.base import Algorithm, Data, Numbers, frozen_copy
from automodel_ckpt.algorithms.context import LossResult, TrainContext, row_inputs
from automodel_ckpt.algorithms.sft.algorithm import map_loader, rank_zero_first
from automodel_ckpt.ondisk import RunFolder, is_count
from automodel_ckpt.checkpoint import fetch_run_file, run_folder, share_run_file
from automodel_ckpt.algorithms.dpo.config import DPOConfig
from automodel_ckpt.data import IGNORE_INDEX, MicroBatch, PairData, pair_batches, prepare_pairs
from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.env import all_gather_object, barrier
from automodel_ckpt.distributed.pipeline import Pipeline
from automodel_ckpt.errors import CheckpointError, ConfigError
from automodel_ckpt.models.build import local_model_path
from automodel_ckpt.algorithms.dpo.losses import METRICS, PreferenceLoss, response_log_probs
from automodel_ckpt.training.reference import StoredLogProbs, mix_into, reference_identity, weights_fingerprint

TRAIN, VALIDATION = "train", "validation"
_COUNTS = ("dpo_step", "consumed_pairs", "ref_syncs")
_KEYS = ("reference_fingerprint", "ref_log_probs_key")
_HEX = re.compile(r"[0-9a-f]{1,64}")


def _kind(value: Any) -> str:
    """A value read from a state file, in a few words (never its content)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"the integer {value}" if abs(value) < 10**12 else "an integer out of range"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return "nothing" if value is None else f"a {type(value).__name__}"


class PreferenceCounters:
    """The counters and the reference's record, checked on resume (checkpointed as ``dpo``)."""

    def __init__(self) -> None:
        self.dpo_step = 0
        self.consumed_pairs = 0
        self.ref_syncs = 0
        self.last_sync_step: int | None = None
        self.reference_fingerprint: str | None = None  # the live full-model reference's starting weights
        self.ref_log_probs_key: str | None = None  # the stored log-probs' data and reference

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's (untrusted) counters: each of the type it has here, else ``CheckpointError``."""
        where = "the preference counters"
        if not isinstance(state, dict):
            raise CheckpointError(f"{where} are {_kind(state)}, not a mapping")
        for key, default in vars(PreferenceCounters()).items():
            value = state.get(key, default)
            if key in _COUNTS and not is_count(value):
                raise CheckpointError(f"{where}: '{key}' is {_kind(value)}, not a count")
            if key == "last_sync_step" and not (value is None or is_count(value)):
                raise CheckpointError(f"{where}: '{key}' is {_kind(value)}, not a step")
            if key in _KEYS and not (value is None or isinstance(value, str) and _HEX.fullmatch(value)):
                raise CheckpointError(f"{where}: '{key}' is {_kind(value)}, not a fingerprint")
            setattr(self, key, value)

    def shown(self) -> dict[str, Any]:
        """What ``ckpt-train inspect`` lists (the checkpoint's metadata holds it)."""
        return {"dpo_step": self.dpo_step, "consumed_pairs": self.consumed_pairs, "ref_syncs": self.ref_syncs,
                "last_sync_step": self.last_sync_step}


@dataclass
class PairTarget:
    """Per row (chosen rows, then rejected): labels, the reference's summed log-prob (or 0), whether it counts."""

    labels: torch.Tensor
    ref: torch.Tensor
    keep: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, index: torch.Tensor) -> PairTarget:
        """These rows (a pipeline microbatch's)."""
        index = index.to(self.labels.device)
        return PairTarget(self.labels[index], self.ref[index], self.keep[index])


class Preference(Algorithm):
    """Preference tuning (``dpo:`` keys, docs/preference.md): pairs, a pair loss against a reference, counters.

    The reference is a frozen copy of the model (checkpointed as ``ref_model`` from its first sync on), the policy
    with its LoRA adapters disabled, or its log-probs stored in the run folder (``precompute_ref_log_probs``)."""

    ref_model: Any = None
    bar_metrics = ("reward_accuracy",)
    _split = TRAIN  # which stored reference log-probs a batch reads
    _stored: StoredLogProbs | None = None
    _ref_pipeline: Pipeline | None = None  # under pipeline stages: the reference's forward, staged like the policy's

    def __init__(self, ctx: TrainContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        section = cfg.dpo if cfg.get("dpo") is not None else OmegaConf.structured(DPOConfig)
        if ctx.run.checkpoint.load_only and cfg.peft is None and section.loss != "simpo":
            # the reference comes from model.pretrained_model_name_or_path: it would not be the weights loaded
            raise ConfigError("checkpoint.load_only: a preference run's reference starts from the model's weights "
                              "folder, not from a checkpoint; start from the SFT run's export instead: "
                              "--model.pretrained_model_name_or_path CHECKPOINT/model/consolidated")
        self.dpo_cfg = section
        self.objective = PreferenceLoss.from_section(section)
        self.dpo = PreferenceCounters()
        self._peft = cfg.peft is not None
        self.state_meaning = {"dpo.fields": [section.prompt_field, section.chosen_field, section.rejected_field]}

    def build(self) -> None:
        """The reference: the policy with adapters disabled (LoRA, staged), or a frozen copy."""
        ctx = self.ctx
        if ctx.forward.pipeline is not None and self._peft and self.objective.needs_reference:
            self._ref_pipeline = self._stage_reference(ctx.model)  # the policy with its adapters disabled
        if self.objective.needs_reference and not self._peft and not self.dpo_cfg.precompute_ref_log_probs:
            self.ref_model = self._build_reference()  # a checkpoint's, if it holds one (``restored`` says)

    # ------------------------------------------------------------------------------------------ data
    def build_loader(self) -> Data:
        """The pairs' loader and this rank's held-out batches."""
        ctx = self.ctx
        self._pairs = prepared = rank_zero_first(ctx, lambda: prepare_pairs(ctx.cfg, ctx.tokenizer))
        loader = map_loader(ctx, prepared.train, "pairs")
        val = prepared.validation
        batches = pair_batches(val, local_batch_size=ctx.cfg.step_scheduler.local_batch_size, rank=ctx.dims.dp_rank,
                               world_size=ctx.dims.dp_size) if val is not None and len(val) else None
        return Data(loader, batches, prepared.report())

    # ------------------------------------------------------------------------------------- reference
    def _build_reference(self) -> torch.nn.Module:
        """A frozen copy of the model sharded like the policy (``frozen_copy``); its weights come in restore."""
        ref, self._ref_weights = frozen_copy(self.ctx)
        ref.checkpoint_optional = True  # saved from its first sync on: absent from earlier checkpoints
        if self.ctx.forward.plan is not None:
            self._ref_pipeline = self._stage_reference(ref)
        return ref

    def _stage_reference(self, model: torch.nn.Module) -> Pipeline:
        """The reference's forward under the policy's pipeline plan: each row's summed log-prob, on the last stage."""
        ctx = self.ctx
        return Pipeline(model, ctx.dims, ctx.forward.plan, ctx.env.device,
                        functools.partial(response_log_probs, ignore_index=IGNORE_INDEX),
                        rows=ctx.cfg.step_scheduler.local_batch_size)

    def pipeline_rows(self, mb: MicroBatch) -> torch.Tensor | None:
        """Under pipeline stages, each microbatch holds whole pairs: its chosen rows, then their rejected rows."""
        forward = self.ctx.forward
        if forward.pipeline is None:
            return None
        half = len(mb.sample_ids)
        k = half // forward.plan.microbatches
        blocks = [torch.arange(j, j + k) for j in range(0, half, k)]
        return torch.cat([torch.cat([b, b + half]) for b in blocks])

    def restored(self, states: set[str]) -> None:
        """The reference settled and checked, the stored log-probs read; a reference is saved once a sync changed it."""
        ctx = self.ctx
        if self._peft:  # its first forward may be the reference's, adapters disabled: nothing trainable then
            data_parallel.build_reducer(ctx.model, ctx.forward.choice)
        if self.ref_model is not None:
            self._settle_reference("ref_model" in states)
        if self.dpo_cfg.precompute_ref_log_probs:
            self._stored = self._stored_log_probs()
        elif self._peft and self.objective.needs_reference and ctx.env.is_main:
            ctx.run.say("Reference model: the policy with its LoRA adapters disabled (no second copy)")
        self._save_reference(bool(self.dpo.ref_syncs))

    def _save_reference(self, saved: bool) -> None:
        """``ref_model`` in the checkpointed state (from its first sync on) or left out."""
        self.checkpoint_exclude = Algorithm.checkpoint_exclude | (frozenset() if saved else {"ref_model"})

    def _settle_reference(self, loaded: bool) -> None:
        """A reference not restored: from the starting weights, checked against the recorded fingerprint."""
        ctx = self.ctx
        if loaded:
            if ctx.env.is_main:
                ctx.run.say(f"Reference model: restored from the checkpoint (synced {self.dpo.ref_syncs} "
                            f"time(s), last at step {self.dpo.last_sync_step})")
            return
        if self.dpo.ref_syncs:
            raise CheckpointError(f"the checkpoint's counters say the reference was synced {self.dpo.ref_syncs} "
                                  "time(s), but it holds no ref_model; it cannot be resumed as a preference run")
        self._ref_weights.fill(self.ref_model, model_loaded=False)
        fingerprint = self._reference_fingerprint()
        recorded = self.dpo.reference_fingerprint
        if recorded is not None and recorded != fingerprint:
            raise CheckpointError(f"the reference model does not match this run's: its starting weights "
                                  f"({ctx.cfg.model.get('pretrained_model_name_or_path')}) have fingerprint "
                                  f"{fingerprint}, the run recorded {recorded}; resume with the same base")
        self.dpo.reference_fingerprint = fingerprint
        if ctx.env.is_main:
            ctx.run.say(f"Reference model: a frozen copy of the starting weights (fingerprint {fingerprint}; "
                        "not saved until it is synced)")

    def _reference_fingerprint(self) -> str:
        """The reference's weights fingerprint; under pipeline stages, of every stage's (one per pipeline size)."""
        fingerprint = weights_fingerprint(self.ref_model)
        if self.ctx.forward.pipeline is None:
            return fingerprint
        stages = sorted(set(all_gather_object(fingerprint)))
        return hashlib.sha256(f"stages/{'/'.join(stages)}".encode()).hexdigest()[:24]

    def _stored_log_probs(self) -> StoredLogProbs:
        """The reference log-probs of every pair, from the run folder, or computed once and stored there."""
        ctx = self.ctx
        data, checkpoint = self._pairs, ctx.run.checkpoint
        base = local_model_path(ctx.cfg.model.get("pretrained_model_name_or_path"))
        identity = reference_identity(OmegaConf.to_container(ctx.cfg.model, resolve=True), base,
                                      adapters_disabled=self._peft)
        parts = [data.train.fingerprint, data.validation.fingerprint if data.validation is not None else None,
                 identity, str(ctx.cfg.distributed.mixed_precision)]
        key = hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()[:24]
        if self.dpo.ref_log_probs_key is not None and self.dpo.ref_log_probs_key != key:
            raise CheckpointError("the reference log-probs do not match this run's: the data or the reference "
                                  f"(model: {ctx.cfg.model.get('pretrained_model_name_or_path')}) changed since "
                                  f"they were computed (key {self.dpo.ref_log_probs_key}, now {key}); resume with "
                                  "the same data and base")
        self.dpo.ref_log_probs_key = key
        root = run_folder(checkpoint)
        file = RunFolder(root).ref_log_probs(key)
        pairs = {TRAIN: len(data.train), **({VALIDATION: len(data.validation)} if data.validation is not None else {})}
        # an object store's copy into this node's mirror; every rank reads it, or every rank computes
        stored = StoredLogProbs.load(file, key, root=root, pairs=pairs) \
            if fetch_run_file(checkpoint, file) or os.path.lexists(file) else None
        if all(all_gather_object(stored is not None)):
            if ctx.env.is_main:
                ctx.run.say(f"Reference log-probs: read from {file}")
            return stored
        ctx.model.eval()  # the reference's log-probs without dropout (training sets train mode again)
        if self._peft:
            compute = self._adapters_disabled_log_probs
        else:
            self.ref_model = self._build_reference()
            self._ref_weights.fill(self.ref_model, model_loaded=False)
            compute = self._reference_model_log_probs
        tables = {TRAIN: self._log_prob_table(data.train, compute)}
        if data.validation is not None:
            tables[VALIDATION] = self._log_prob_table(data.validation, compute)
        stored = StoredLogProbs(key, tables)
        if ctx.env.is_main:
            stored.save(file, root)
            ctx.run.say(f"Reference log-probs: computed for {sum(t.shape[1] for t in tables.values())} "
                        f"pairs, stored in {file}")
            try:  # where the run folder lives (an object store): a resume on another machine reads them back
                share_run_file(checkpoint, file)
            except CheckpointError as exc:  # a later run computes them again
                ctx.run.say(f"warning: the reference log-probs stay in {file} only: {exc}")
        barrier()
        self.ref_model = None  # not kept in memory
        if not self._peft:
            self._ref_pipeline = None
        gc.collect()
        return stored

    def _log_prob_table(self, data: PairData, compute: Any) -> torch.Tensor:
        """``[2, pairs]`` float64: every pair's reference log-probs, each rank computing its share."""
        ctx = self.ctx
        table = torch.zeros(2, len(data), dtype=torch.float64)
        mine = []
        for mb in pair_batches(data, local_batch_size=ctx.cfg.step_scheduler.local_batch_size,
                               rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size):
            sums = compute(mb)
            if sums is None:  # a pipeline stage before the last: the last one computes them
                continue
            sums = sums.double().cpu()
            keep = mb.sample_ids >= 0
            half = len(mb.sample_ids)
            mine.append(torch.stack([mb.sample_ids[keep].double(), sums[:half][keep], sums[half:][keep]]))
        local = torch.cat(mine, dim=1) if mine else torch.zeros(3, 0, dtype=torch.float64)
        parts = all_gather_object(local) if ctx.dims.dp_size > 1 or ctx.forward.pipeline is not None else [local]
        for part in parts:
            table[:, part[0].long()] = part[1:]
        return table

    # ------------------------------------------------------------------------------------- log-probs
    def _log_probs(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor | None:
        """Per row: the summed log-probs of the scored tokens (None on a pipeline stage before the last)."""
        if self._ref_pipeline is not None:
            return self._ref_pipeline.forward_rows(mb.input_ids, mb.labels, row_inputs(mb))
        logits = self.ctx.forward.logits(mb, model)
        return response_log_probs(logits, mb.labels.to(self.ctx.env.device), IGNORE_INDEX)

    @torch.no_grad()
    def _reference_model_log_probs(self, mb: MicroBatch) -> torch.Tensor | None:
        return self._log_probs(self.ref_model, mb)

    @torch.no_grad()
    def _adapters_disabled_log_probs(self, mb: MicroBatch) -> torch.Tensor | None:
        with self.ctx.model.disable_adapter():
            return self._log_probs(self.ctx.model, mb)

    def _reference(self, mb: MicroBatch, split: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pairs' reference log-probs (chosen, rejected), summed; None without a reference (SimPO)."""
        if not self.objective.needs_reference:
            return None, None
        if self._stored is not None:
            chosen, rejected = self._stored.lookup(split, mb.sample_ids)
            return chosen.to(self.ctx.env.device), rejected.to(self.ctx.env.device)
        sums = (self._adapters_disabled_log_probs if self._peft else self._reference_model_log_probs)(mb)
        if sums is None:  # a pipeline stage before the last: no loss is computed here
            return None, None
        half = len(mb.sample_ids)
        return sums[:half].double(), sums[half:].double()

    # ----------------------------------------------------------------------------- the loss (the step is shared)
    def loss_count(self, mb: MicroBatch) -> torch.Tensor:
        """The loss is the mean over the batch's pairs (a filled pair, sample id -1, is not one)."""
        return (mb.sample_ids >= 0).sum()

    def loss_target(self, mb: MicroBatch) -> PairTarget:
        """The pairs' labels, the reference's log-probs and which pairs count (``PairTarget``)."""
        device = self.ctx.env.device
        ref_chosen, ref_rejected = self._reference(mb, self._split)
        half = len(mb.sample_ids)
        ref = (torch.cat([ref_chosen, ref_rejected]).to(device) if ref_chosen is not None
               else torch.zeros(2 * half, dtype=torch.float64, device=device))
        keep = (mb.sample_ids >= 0).repeat(2).to(device=device, dtype=torch.float64)
        return PairTarget(mb.labels.to(device), ref, keep)

    def compute_loss(self, logits: torch.Tensor, target: PairTarget) -> LossResult:
        """The summed pair losses and metric sums (training counts every pair, validation only those that count)."""
        labels, ref, keep = target.labels.to(logits.device), target.ref.to(logits.device), target.keep
        half = len(labels) // 2
        sums = response_log_probs(logits, labels, IGNORE_INDEX).double()
        counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).double()
        refs = (ref[:half], ref[half:]) if self.objective.needs_reference else (None, None)
        losses, chosen, rejected = self.objective(sums[:half], sums[half:], *refs, counts[:half], counts[half:])
        weight = keep[:half].to(logits.device) if self._split == VALIDATION else None
        return LossResult(losses.sum(), self.objective.sums(losses, chosen, rejected, weight=weight))

    def _metrics(self, sums: list[torch.Tensor | None], prefix: str, count: float, local: bool
                 ) -> tuple[float, dict[str, Any]]:
        """The loss and metrics of ``sums`` over stages and ranks, each a mean over ``count`` (``local``: summed)."""
        total = torch.zeros(len(METRICS), dtype=torch.float64, device=self.ctx.env.device)
        for call in sums:
            total += call
        total = self.ctx.dims.sum_over_stages(total.cpu())
        if local:
            total = self.ctx.dims.sum_over_dp(torch.cat([total, torch.tensor([count], dtype=torch.float64)]))
            total, count = total[:-1], total[-1].item()
        else:
            total = self.ctx.dims.sum_over_dp(total)
        values = dict(zip(METRICS, (total / max(count, 1.0)).tolist()))
        return values["loss"], {f"{prefix}{k}": values[k] for k in METRICS[1:]}

    # ------------------------------------------------------------------------------------------ step
    def step_done(self, loss: float, global_count: float, sums: list[torch.Tensor | None]) -> Numbers:
        """The counters, the TR-DPO sync and the step's metrics (the loss: the mean over the global batch's pairs)."""
        self.dpo.dpo_step += 1
        self.dpo.consumed_pairs += int(global_count)
        self._maybe_sync_reference()
        loss, metrics = self._metrics(sums, "", global_count, local=False)
        return Numbers(loss, metrics | {"dpo_step": self.dpo.dpo_step, "consumed_pairs": self.dpo.consumed_pairs})

    def _maybe_sync_reference(self) -> None:
        """TR-DPO: every ``ref_model_sync_steps`` steps the policy is mixed into the reference (then checkpointed)."""
        cfg = self.dpo_cfg
        if not cfg.sync_ref_model or self.ref_model is None or self.dpo.dpo_step % cfg.ref_model_sync_steps:
            return
        self.ctx.run.fence()  # an async save may still be copying the reference
        mix_into(self.ref_model, self.ctx.model, float(cfg.ref_model_mixup_alpha))
        self.dpo.ref_syncs += 1
        self.dpo.last_sync_step = self.dpo.dpo_step
        self._save_reference(True)

    @torch.no_grad()
    def validate(self, batches: list[MicroBatch]) -> Numbers:
        self.ctx.model.eval()
        sums: list[torch.Tensor | None] = []
        self._split, pairs = VALIDATION, 0
        try:
            for mb in batches:
                sums += self.ctx.forward.evaluate(mb, self.loss_target(mb))[1]
                pairs += int((mb.sample_ids >= 0).sum())
        finally:
            self._split = TRAIN
        return Numbers(*self._metrics(sums, "val_", float(pairs), local=True))

    def save_extra(self) -> dict[str, Any]:
        return {"counters": self.dpo.shown()}
