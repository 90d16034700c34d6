"""Online RL (GRPO) as an algorithm: each step's batches sampled from the policy, scored, and learned from.

Each rollout batch's rewards are normalised within each prompt's group, then ``grpo.num_iterations`` optimizer steps
take the clipped-ratio loss over it (docs/rl.md). Checkpoints hold every counter, the prompt position and the
rollout batch in use: a resume continues bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from automodel_ckpt.algorithms.base import Algorithm, Data, Numbers, frozen_copy
from automodel_ckpt.algorithms.context import LossResult, TrainContext
from automodel_ckpt.algorithms.grpo.engine import EngineLost, Sync, VLLMEngine
from automodel_ckpt.algorithms.grpo.engine_loop import EngineLoop
from automodel_ckpt.algorithms.grpo.state import GRPOCounters, PromptLoader, RolloutBatch, RolloutExpected
from automodel_ckpt.config.instantiate import locate
from automodel_ckpt.algorithms.grpo.config import GRPOConfig, check_section
from automodel_ckpt.data import MicroBatch, prompt_columns
from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.env import all_gather_object, all_reduce_sum
from automodel_ckpt.distributed.fsdp import gathered_between_forwards
from automodel_ckpt.distributed.tensor_parallel import causal_lm
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.training.reference import mix_into
from automodel_ckpt.training.rewards import score
from automodel_ckpt.training.rollout import IGNORE, advantages, clipped_loss, generate, sample_seed, \
    token_log_probs


FLAT_BATCHES_WARNING = 10  # rollout batches in a row with every advantage 0 before the one warning


def reward_function(spec: Any) -> tuple[str, Callable[..., Any]]:
    """A ``grpo.reward_funcs`` entry (a dotted name, or ``_target_`` and keyword arguments): its name, the function."""
    if isinstance(spec, str):
        target, kwargs = spec, {}
    elif hasattr(spec, "get") and isinstance(spec.get("_target_"), str):
        target = spec.get("_target_")
        kwargs = {k: v for k, v in dict(spec).items() if k != "_target_"}
    else:
        raise ConfigError(f"grpo.reward_funcs: an entry is {type(spec).__name__}, not a dotted name or a "
                          "mapping with _target_")
    fn = locate(target, "grpo.reward_funcs")
    if not callable(fn):
        raise ConfigError(f"grpo.reward_funcs: {target} is not callable")
    return target.rsplit(".", 1)[-1], functools.partial(fn, **kwargs) if kwargs else fn


def vocab_rows(model: Any) -> int:
    """The token ids ``model`` takes and scores: its input embedding's rows (and its head's, if fewer)."""
    lm = causal_lm(model)
    parts = [(getattr(lm, name, lambda: None)(), attr) for name, attr in
             (("get_input_embeddings", "num_embeddings"), ("get_output_embeddings", "out_features"))]
    sizes = [s for s in (getattr(module, attr, None) for module, attr in parts) if isinstance(s, int)]
    config_size = getattr(getattr(lm, "config", None), "vocab_size", None)
    if not sizes and not isinstance(config_size, int):
        raise ConfigError("grpo: the model has no input embedding and no config.vocab_size: its token ids are unknown")
    return min(sizes) if sizes else config_size


def take_prompts(order: torch.Tensor, position: int, lengths: list[int], want: int, limit: int
                 ) -> tuple[list[int], int, int]:
    """The next ``want`` prompt ids of ``order`` from ``position`` that fit ``limit``, the position after, skipped."""
    ids, skipped = [], 0
    while position < len(order) and len(ids) < want:
        pid = int(order[position])
        position += 1
        if lengths[pid] > limit:
            skipped += 1
            continue
        ids.append(pid)
    return ids, position, skipped


@dataclass
class RolloutRows:
    """A micro-batch's rows of the rollout batch: labels, log-probs as sampled and the reference's, advantages."""

    labels: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    advantages: torch.Tensor


class GRPO(EngineLoop, Algorithm):
    """GRPO (``grpo:`` keys); ``ref_model`` (``beta`` > 0, full fine-tune) is the policy as the run started."""

    ref_model: Any = None
    bar_metrics = ("reward",)

    def __init__(self, ctx: TrainContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        section = cfg.grpo if cfg.get("grpo") is not None else OmegaConf.structured(GRPOConfig)
        check_section(section, cfg.step_scheduler.global_batch_size, int(cfg.distributed.get("pp_size") or 1))
        self.grpo_cfg = section
        self._rewards = [reward_function(s) for s in section.reward_funcs]
        weights = list(section.reward_weights) if section.reward_weights is not None else [1.0] * len(self._rewards)
        if len(weights) != len(self._rewards) or not self._rewards:
            raise ConfigError(f"grpo.reward_weights: {len(weights)} weights for {len(self._rewards)} reward functions")
        self._weights = torch.tensor(weights, dtype=torch.float64)
        self._peft = cfg.peft is not None
        self.grpo = GRPOCounters()
        self.rollout = RolloutBatch()
        self._generation_seconds = 0.0
        self._train_start = 0.0
        self.engine: VLLMEngine | None = None  # grpo.engine vllm (``build``); None: sampled in process
        self._sync: Sync | None = None  # this step's weight push to the engine, if it made one
        self._slots: list[RolloutBatch] = []  # grpo.max_staleness K: the next K batches, sampled ahead
        for k in range(1, section.max_staleness + 1):  # checkpointed (next_rollout, next_rollout_2, ...): resumed on
            self._slots.append(RolloutBatch(ahead=True))
            setattr(self, "next_rollout" + (f"_{k}" if k > 1 else ""), self._slots[-1])
        self._warned = False
        self._flat = 0  # rollout batches in a row whose every advantage is 0 (``_check_signal``)
        self._orders: dict[int, torch.Tensor] = {}
        #: what a rollout batch and the counters mean: the group size and the reward functions
        self.state_meaning = {"grpo.num_generations": section.num_generations,
                              "grpo.reward_funcs": [name for name, _ in self._rewards]}

    # ------------------------------------------------------------------------------------- reference
    def build(self) -> None:
        """The reference, what a checkpoint's rollout batch is checked against, and the engine."""
        if self.grpo_cfg.beta > 0 and not self._peft:
            self.ref_model, self._ref_weights = frozen_copy(self.ctx)  # filled in ``restored``
        cfg = self.ctx.cfg
        self.rollout.expected = RolloutExpected(
            rows=cfg.step_scheduler.global_batch_size, group=self.grpo_cfg.num_generations,
            reward_functions=len(self._rewards), vocab=vocab_rows(self.ctx.model), seq_length=cfg.data.seq_length,
            prompts=getattr(self, "_prompt_ids", []))
        for slot in self._slots:
            slot.expected = self.rollout.expected
        if self.grpo_cfg.engine == "vllm":
            self.engine = VLLMEngine(self.grpo_cfg.vllm, self.ctx.env.is_main)
            self.engine.start(self.ctx.model, cfg.data.seq_length)  # starting while the checkpoint loads

    def restored(self, states: set[str]) -> None:
        """The reference: the checkpoint's, else the policy as this run starts (a ``restore_from`` SFT model)."""
        ctx = self.ctx
        if self.engine is not None:
            self.engine.ready()  # an engine that cannot serve this model: one line, before training
        self._check_slots()
        if self._peft:
            data_parallel.build_reducer(ctx.model, ctx.forward.choice)
        if self.ref_model is None or "ref_model" in states:
            return
        self._ref_weights.fill(self.ref_model, model_loaded=False)  # buffers and every parameter set
        with torch.no_grad():
            mix_into(self.ref_model, ctx.model, 1.0)  # 0 * x + p: the policy's values exactly

    # ------------------------------------------------------------------------------------------ data
    def build_loader(self) -> Data:
        """The prompts with their answers, and their ``PromptLoader``; no validation."""
        ctx, section = self.ctx, self.grpo_cfg
        self._prompts, self._answers = prompt_columns(ctx.cfg, section.prompt_field, section.answer_field, "grpo")
        tok = ctx.tokenizer
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        encoded = tok(self._prompts, add_special_tokens=False, verbose=False)["input_ids"]
        self._prompt_ids = [bos + list(e) for e in encoded]
        sched = ctx.cfg.step_scheduler
        per_rollout = sched.global_batch_size // section.num_generations
        loader = PromptLoader(self._next_rollout, self.grpo, sched.global_batch_size,
                              sched.global_batch_size // (sched.local_batch_size * ctx.dims.dp_size),
                              max(1, len(self._prompts) // per_rollout) * section.num_iterations)
        return Data(loader, None, f"Prompts: {len(self._prompts)} ({section.num_generations} completions each, "
                                  f"{per_rollout} per rollout batch)")

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            n, cfg = len(self._prompts), self.ctx.cfg
            self._orders = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
                            if cfg.data.shuffle else torch.arange(n)}
        return self._orders[epoch]

    def _next_prompts(self, want: int) -> list[int]:
        """The next ``want`` prompts of the data order (epochs roll over); too long ones counted and skipped."""
        ctx, g = self.ctx, self.grpo
        limit = ctx.cfg.data.seq_length - self.grpo_cfg.max_new_tokens
        lengths = [len(p) for p in self._prompt_ids]
        ids: list[int] = []
        for _ in range(3):
            got, g.prompt_position, skipped = take_prompts(self._order(g.prompt_epoch), g.prompt_position, lengths,
                                                           want - len(ids), limit)
            ids += got
            if skipped:
                g.skipped_prompts += skipped
                if not self._warned and ctx.env.is_main:
                    warnings.warn(f"grpo: prompts longer than data.seq_length - grpo.max_new_tokens ({limit} tokens) "
                                  f"are skipped ({g.skipped_prompts} so far; counted as skipped_prompts)",
                                  stacklevel=2)
                self._warned = True
            if len(ids) == want:
                return ids
            g.prompt_epoch, g.prompt_position = g.prompt_epoch + 1, 0
        raise ConfigError(f"grpo: fewer than {want} prompts fit in data.seq_length - grpo.max_new_tokens ({limit})")

    # ------------------------------------------------------------------------------------- rollouts
    def _next_rollout(self) -> tuple[int, list[MicroBatch]]:
        """This step's prompt epoch and micro-batches: a new rollout batch once the last had its passes."""
        self._generation_seconds, self._sync = 0.0, None
        if self.rollout.rows == 0 or self.rollout.passes >= self.grpo_cfg.num_iterations or self._made_for_one_pass():
            t0, kept = time.perf_counter(), self._kept()
            try:
                if self._lost is not None:  # lost twice as the last step asked ahead: that step saved, then stop
                    lost, self._lost = self._lost, None
                    raise lost
                if not self._take_ahead():
                    self._make_rollout()
                if self._slots:  # grpo.max_staleness
                    self._sample_ahead()
            except EngineLost as lost:  # lost again after its restart: the last step's state back, and saved
                self._put_back(kept)
                lost.save_last_step = True
                raise
            self._generation_seconds = time.perf_counter() - t0 - (self._sync.sync_seconds if self._sync else 0.0)
        self._train_start = time.perf_counter()
        return self.grpo.prompt_epoch, self._micro_batches()

    def _share(self, rows: int) -> range:
        dims = self.ctx.dims
        per = rows // dims.dp_size
        return range(dims.dp_rank * per, (dims.dp_rank + 1) * per)

    def _sample(self, step: int, rows: list[tuple[int, int]]) -> list[list[int]]:
        """This rank's completions of ``rows`` (prompt id, sample index), every rank stepping together."""
        ctx, section = self.ctx, self.grpo_cfg
        tok = ctx.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        distributed = ctx.env.world_size > 1
        keep_going = (lambda done: all_reduce_sum(0.0 if done else 1.0).item() > 0) if distributed else None
        ctx.model.eval()
        with ctx.forward.compute(), gathered_between_forwards(ctx.model, self._gather_budget):
            return generate(ctx.model, [self._prompt_ids[p] for p, _ in rows],
                            [sample_seed(ctx.cfg.seed, step, p, i) for p, i in rows],
                            max_new_tokens=section.max_new_tokens, temperature=section.temperature,
                            eos_id=tok.eos_token_id, pad_id=pad, device=ctx.env.device, keep_going=keep_going)

    @functools.cached_property
    def _gather_budget(self) -> int:
        """The whole model stays gathered for sampling where its weights take at most a quarter of a rank's memory."""
        return data_parallel.rank_memory(self.ctx.env.device) // 4

    def _score(self, rows: list[tuple[int, int]], completions: list[list[int]]) -> torch.Tensor:
        """``[rows, functions]``: each reward function's reward of each completion."""
        tok = self.ctx.tokenizer
        eos = tok.eos_token_id
        ended = [bool(c) and c[-1] == eos for c in completions]
        texts = [tok.decode(c[:-1] if e else c, skip_special_tokens=True) for c, e in zip(completions, ended)]
        prompts = [self._prompts[p] for p, _ in rows]
        answers = [self._answers[p] for p, _ in rows]
        columns = [score(name, fn, prompts, texts, answers, ended) for name, fn in self._rewards]
        return torch.tensor(columns, dtype=torch.float64).T.reshape(len(rows), len(columns))

    def _take_rollout(self) -> tuple[int, list[tuple[int, int]], list[int]]:
        """The next rollout batch's ``grpo_step``, rows (prompt id, sample index) and prompts (taken)."""
        group = self.grpo_cfg.num_generations
        prompts = self._next_prompts(self.ctx.cfg.step_scheduler.global_batch_size // group)
        return self.grpo.grpo_step + 1, [(p, i) for p in prompts for i in range(group)], prompts

    def _make_rollout(self) -> None:
        """The next rollout batch: sampled, scored and gathered, with the policy's and the reference's log-probs."""
        step, rows, prompts = self._take_rollout()
        share = self._share(len(rows))
        if self.engine is not None:
            everyone = self._engine_rollout(step, rows)
            completions = [everyone[r] for r in share]
        else:
            completions = self._sample(step, [rows[r] for r in share])
        self._fill(self.rollout, step, rows, prompts, completions)
        self.rollout.weight_version = self.grpo.ppo_optimization_step
        self.rollout.weight_hash, self.rollout.engine_hash = (self.engine.hash, self.engine.engine_hash) \
            if self.engine else ("", "")
        t = self.rollout.tensors
        t["old_log_probs"], t["ref_log_probs"] = self._log_probs()

    def _fill(self, batch: RolloutBatch, step: int, rows: list[tuple[int, int]], prompts: list[int],
              completions: list[list[int]]) -> None:
        """``batch`` from this rank's ``completions``: scored, gathered, advantages per group; counters moved."""
        ctx, section, g = self.ctx, self.grpo_cfg, self.grpo
        group = section.num_generations
        mine = [rows[r] for r in self._share(len(rows))]
        rewards = self._score(mine, completions)
        parts = all_gather_object((ctx.dims.tp_rank, ctx.dims.dp_rank, completions, rewards))
        parts = sorted((p for p in parts if p[0] == 0), key=lambda p: p[1])
        completions = [c for p in parts for c in p[2]]
        rewards = torch.cat([p[3] for p in parts])
        tensors = self._rows_tensors(rows, completions)
        tensors["rewards"] = rewards
        total = rewards @ self._weights
        tensors["advantages"] = advantages(section.advantage, total, group, [n for n, _ in self._rewards])
        self._check_signal(tensors["advantages"])
        batch.tensors, batch.step, batch.passes = tensors, step, 0
        g.grpo_step = step
        g.consumed_prompts += len(prompts)
        g.generated_completions += len(rows)
        g.generated_tokens += sum(len(c) for c in completions)
        g.reward_sum += float(total.sum())
        g.reward_square_sum += float((total * total).sum())

    def _check_signal(self, advantage: torch.Tensor) -> None:
        """Warn once when ``FLAT_BATCHES_WARNING`` rollout batches in a row had every advantage 0 (nothing learned)."""
        flat = advantage.numel() == 0 or float(advantage.abs().max()) < 1e-9  # 0 but for a mean's rounding
        self._flat = self._flat + 1 if flat else 0
        if self._flat == FLAT_BATCHES_WARNING and self.ctx.env.is_main:
            warnings.warn(f"grpo: in the last {FLAT_BATCHES_WARNING} rollout batches every group's completions were "
                          "rewarded alike (every advantage 0): nothing is learned. Start from a model that sometimes "
                          "earns the reward (an SFT checkpoint: --checkpoint.restore_from, docs/rl.md), or weigh in "
                          "partial-credit rewards (grpo.reward_weights) with grpo.advantage normalized", stacklevel=2)

    def _rows_tensors(self, rows: list[tuple[int, int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
        tok = self.ctx.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        seqs = [self._prompt_ids[p] + c for (p, _), c in zip(rows, completions)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
        n = len(rows)
        return {"prompt_ids": torch.tensor([p for p, _ in rows], dtype=torch.int64),
                "sample_index": torch.tensor([i for _, i in rows], dtype=torch.int64), "input_ids": ids,
                "prompt_length": torch.tensor([len(self._prompt_ids[p]) for p, _ in rows], dtype=torch.int64),
                "length": torch.tensor([len(s) for s in seqs], dtype=torch.int64),
                "old_log_probs": torch.zeros(n, width, dtype=torch.float64),
                "ref_log_probs": torch.zeros(n, width, dtype=torch.float64)}

    def _made_for_one_pass(self) -> bool:
        """A one-pass batch (log-probs as sampled: NaN) resumed with more passes: a new one is sampled."""
        return bool(self.rollout.passes and torch.isnan(self.rollout.tensors["old_log_probs"]).any())

    def _one_pass(self) -> bool:
        """One optimizer step per rollout batch: the weights that sampled are the step's, so the ratio's denominator
        is the pass's own log-probs, detached (ratio 1, as TRL does), with no forward of their own."""
        return self.grpo_cfg.num_iterations == 1 and not self.grpo_cfg.get("max_staleness")

    @torch.no_grad()
    def _log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the policy's log-prob before the passes (NaN with ``_one_pass``) and the reference's (or 0)."""
        ctx = self.ctx
        t = self.rollout.tensors
        policy_too = not self._one_pass()
        old = torch.zeros_like(t["old_log_probs"]) if policy_too else torch.full_like(t["old_log_probs"], math.nan)
        ref = torch.zeros_like(t["ref_log_probs"])
        if not policy_too and self.grpo_cfg.beta <= 0:
            return old, ref
        ctx.model.eval()
        mine = []
        for mb in self._micro_batches():
            policy = None
            if policy_too:
                logits = ctx.forward.logits(mb)
                policy = token_log_probs(logits, mb.labels.to(ctx.env.device)).double().cpu()
            mine.append((mb.sample_ids, policy, self._reference_log_probs(mb)))
        parts = all_gather_object((ctx.dims.tp_rank, mine)) if ctx.env.world_size > 1 else [(0, mine)]
        for tp_rank, batches in parts:
            for ids, policy, reference in batches if tp_rank == 0 else []:
                if policy is not None:
                    old[ids] = policy
                if reference is not None:
                    ref[ids] = reference
        return old, ref

    def _reference_log_probs(self, mb: MicroBatch) -> torch.Tensor | None:
        ctx = self.ctx
        if self.grpo_cfg.beta <= 0:
            return None
        dev = ctx.env.device
        mask = mb.attention_mask.to(dev)
        with ctx.forward.compute():
            if self._peft:
                with ctx.model.disable_adapter():
                    logits = ctx.model(input_ids=mb.input_ids.to(dev), attention_mask=mask, use_cache=False).logits
            else:
                logits = self.ref_model(input_ids=mb.input_ids.to(dev), attention_mask=mask, use_cache=False).logits
        return token_log_probs(logits, mb.labels.to(dev)).double().cpu()

    def _micro_batches(self) -> list[MicroBatch]:
        """This rank's rows of the rollout batch in micro-batches of ``local_batch_size``."""
        t = self.rollout.tensors
        local = self.ctx.cfg.step_scheduler.local_batch_size
        share = list(self._share(self.rollout.rows))
        batches = []
        for start in range(0, len(share), local):
            ids = torch.tensor(share[start:start + local], dtype=torch.int64)
            input_ids = t["input_ids"][ids]
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            mask = (pos < t["length"][ids, None]).long()
            labels = input_ids.masked_fill((pos < t["prompt_length"][ids, None]) | (mask == 0), IGNORE)
            batches.append(MicroBatch(input_ids, labels, mask, ids))
        return batches

    # -------------------------------------------------------------------------------------- the loss
    def loss_count(self, mb: MicroBatch) -> torch.Tensor:
        """The loss is the mean over the global batch's completion tokens."""
        return (mb.labels[:, 1:] != IGNORE).sum()

    def loss_target(self, mb: MicroBatch) -> RolloutRows:
        """The micro-batch's rows of the rollout batch (``RolloutRows``)."""
        t, rows, device = self.rollout.tensors, mb.sample_ids, self.ctx.env.device
        return RolloutRows(mb.labels.to(device), t["old_log_probs"][rows].to(device),
                           t["ref_log_probs"][rows].to(device), t["advantages"][rows].to(device))

    def compute_loss(self, logits: torch.Tensor, target: RolloutRows) -> LossResult:
        """The clipped-ratio loss summed over the completions' tokens; its sums ``[tokens, clipped, kl]``."""
        section = self.grpo_cfg
        labels = target.labels
        logp = token_log_probs(logits, labels).double()
        keep = labels != IGNORE  # the completion's tokens; the first column has no logits before it
        keep[:, 0] = False
        ref = target.ref_log_probs if section.beta > 0 else None
        sampled = logp.detach() if self._one_pass() else target.old_log_probs
        return LossResult(*clipped_loss(logp, sampled, ref, target.advantages, keep, epsilon=section.epsilon,
                                        epsilon_high=section.epsilon_high, beta=section.beta))

    # ---------------------------------------------------------------------------------- its counters
    def step_done(self, loss: float, global_count: float, sums: list[torch.Tensor | None]) -> Numbers:
        g = self.grpo
        g.ppo_optimization_step += 1
        self.rollout.passes += 1
        total = torch.stack(sums).sum(dim=0).cpu() if sums else torch.zeros(3, dtype=torch.float64)
        tokens, clipped, kl = self.ctx.dims.sum_over_dp(total).tolist()
        metrics = self._rollout_metrics() | {
            "kl": kl / max(tokens, 1.0), "clip_fraction": clipped / max(tokens, 1.0), "grpo_step": self.rollout.step,
            "ppo_optimization_step": g.ppo_optimization_step, "rollout_pass": self.rollout.passes,
            "generation_seconds": round(self._generation_seconds, 6),
            "train_seconds": round(time.perf_counter() - self._train_start, 6)} | self._engine_metrics()
        if self._ahead is not None:  # the next rollout batch, sampled while this step trained, before the save
            self._finish_ahead()
            metrics["rollout_wait_seconds"] = round(self._waited, 6)
        return Numbers(loss, metrics)

    def _rollout_metrics(self) -> dict[str, Any]:
        """The rollout batch's numbers (from its saved state: the same after a resume)."""
        t = self.rollout.tensors
        total = t["rewards"] @ self._weights
        metrics = {"reward": total.mean().item(), "reward_std": total.std().item() if len(total) > 1 else 0.0}
        for (name, _), column in zip(self._rewards, t["rewards"].T):
            metrics[f"reward_{name}"] = column.mean().item()
        metrics["completion_length"] = (t["length"] - t["prompt_length"]).double().mean().item()
        metrics["completion_hash"] = hashlib.sha256(t["input_ids"].numpy().tobytes()).hexdigest()[:16]
        return metrics

    def save_extra(self) -> dict[str, Any]:
        shown = self.grpo.shown()
        return {"grpo_step": shown["grpo_step"], "ppo_optimization_step": shown["ppo_optimization_step"],
                "counters": shown}
