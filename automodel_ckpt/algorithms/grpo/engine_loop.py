"""GRPO's steps with a vLLM engine: the push before each sample, one restart, and rollouts sampled steps ahead."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from automodel_ckpt.algorithms.grpo.engine import EngineLost, Sync, VLLMEngine
from automodel_ckpt.algorithms.grpo.state import RolloutBatch
from automodel_ckpt.errors import CheckpointError, warn
from automodel_ckpt.training.rollout import sample_seed


_BATCH_FIELDS = ("tensors", "step", "passes", "weight_version", "weight_hash", "engine_hash")  # what moves with a batch


class Ahead:
    """A rollout batch asked of the engine ahead, while this step trains (rank 0's request: a thread)."""

    def __init__(self, engine: VLLMEngine, step: int, rows: list[tuple[int, int]], prompts: list[int],
                 version: int, request: dict[str, Any] | None) -> None:
        self.engine, self.step, self.rows, self.prompts = engine, step, rows, prompts
        self.before: tuple[int, int, int] = (0, 0, 0)  # the prompt counters before its prompts were taken
        self.version, self.digest, self.engine_digest = version, engine.hash, engine.engine_hash
        self.answer: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._ask, args=(request,), daemon=True) if request else None
        if self.thread is not None:
            self.thread.start()

    def _ask(self, request: dict[str, Any]) -> None:
        self.answer = self.engine.request(**request)

    def wait(self) -> tuple[dict[str, Any], float]:
        """Every rank: the engine's answer (rank 0's, broadcast) and the seconds this rank waited for it."""
        t0 = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
        return self.engine.collect(self.answer), time.perf_counter() - t0


class EngineLoop:
    """What ``GRPO`` does with an engine (``grpo.engine vllm``), mixed into it."""

    engine: VLLMEngine | None
    _sync: Sync | None
    _ahead: Ahead | None = None
    _slots: Sequence[RolloutBatch] = ()  # grpo.max_staleness K: the next K rollout batches, sampled ahead
    _waited = 0.0
    _lost: EngineLost | None = None  # lost again as a batch was asked ahead: raised as the next step begins

    def _engine_rollout(self, step: int, rows: list[tuple[int, int]]) -> list[list[int]]:
        """The last step's weights pushed and checked, then every completion of ``rows`` sampled by the engine; an
        engine that died or hung is restarted once and asked again the same."""
        for attempt in (1, 2):
            try:
                self._push()
                return self._engine_sample(step, rows)
            except EngineLost as lost:
                if attempt == 2 or not self.engine.restartable:
                    raise
                if self.ctx.env.is_main:
                    warn(f"grpo.engine vllm: {lost}; restarting the engine (once), rollout batch {step} asked again "
                         "with the same seeds")
                self.engine.restart()
        raise AssertionError("unreachable")

    def _push(self) -> None:
        version = self.grpo.ppo_optimization_step
        if self.engine.version != version:
            self._sync = self.engine.push(self.ctx.model, version)

    def _sampling(self, step: int, rows: list[tuple[int, int]]) -> dict[str, Any]:
        ctx, section = self.ctx, self.grpo_cfg
        return {"prompts": [self._prompt_ids[p] for p, _ in rows],
                "seeds": [sample_seed(ctx.cfg.seed, step, p, i) for p, i in rows],
                "max_new_tokens": section.max_new_tokens, "temperature": section.temperature,
                "eos_id": ctx.tokenizer.eos_token_id}

    def _engine_sample(self, step: int, rows: list[tuple[int, int]]) -> list[list[int]]:
        """Every completion of ``rows`` sampled by the engine, seeded as in process (``sample_seed``)."""
        return self.engine.sample(**self._sampling(step, rows))["completions"]

    # ---------------------------------------------------------------------------- steps ahead
    def _sample_ahead(self) -> None:
        """``grpo.max_staleness`` K: this step's weights pushed, then the rollout batch K steps ahead asked of the
        engine; the empty slots before it (as a run starts, or resumes with fewer) filled first, synchronously."""
        self._push()
        for _ in range(sum(slot.rows == 0 for slot in self._slots) - 1):
            self._ask_ahead()
            self._finish_ahead()
        self._ask_ahead()

    def _ask_ahead(self) -> None:
        g = self.grpo
        before = (g.prompt_epoch, g.prompt_position, g.skipped_prompts)
        self._ahead = self._asked(*self._take_rollout())
        self._ahead.before = before

    def _asked(self, step: int, rows: list[tuple[int, int]], prompts: list[int]) -> Ahead:
        request = self._sampling(step, rows) | {"log_probs": True} if self.ctx.env.is_main else None
        return Ahead(self.engine, step, rows, prompts, self.grpo.ppo_optimization_step, request)

    def _finish_ahead(self) -> None:
        """Before the step's save: the batch asked ahead received, scored and kept in the first empty slot
        (``next_rollout``, ``next_rollout_2``, ...) with the engine's log-probs as sampled (the ratio's denominator:
        those weights are behind the ones that will train on it)."""
        ahead, self._ahead = self._ahead, None
        try:
            answer, self._waited = ahead.wait()
        except EngineLost as lost:
            ahead, answer = self._ask_again(ahead, lost)
            if answer is None:
                return
        everyone = answer["completions"]
        batch = next(slot for slot in self._slots if slot.rows == 0)
        self._fill(batch, ahead.step, ahead.rows, ahead.prompts, [everyone[r] for r in self._share(len(ahead.rows))])
        t = batch.tensors
        old = torch.zeros_like(t["old_log_probs"])
        for row, (start, values) in enumerate(zip(t["prompt_length"].tolist(), answer["log_probs"])):
            old[row, start:start + len(values)] = torch.tensor(values, dtype=torch.float64).clamp_max(0.0)
        t["old_log_probs"] = old
        batch.weight_version, batch.weight_hash, batch.engine_hash = ahead.version, ahead.digest, ahead.engine_digest

    def _ask_again(self, ahead: Ahead, lost: EngineLost) -> tuple[Ahead, dict[str, Any] | None]:
        """The engine lost while a batch was asked ahead (this step trained): restarted once and the batch asked
        again, its rows and seeds, of this step's weights (the ones it was asked of went with the engine: its
        ``weight_version`` says so). Lost again: its prompts given back, its slot left empty, this step whole; the
        run stops as the next step begins, after saving this one (``_lost``)."""
        if self.engine.restartable:
            if self.ctx.env.is_main:
                warn(f"grpo.engine vllm: {lost}; restarting the engine (once), rollout batch {ahead.step} asked "
                     "again with the same seeds and this step's weights")
            try:
                self.engine.restart()
                self._push()
                again = self._asked(ahead.step, ahead.rows, ahead.prompts)
                answer, self._waited = again.wait()
                return again, answer
            except EngineLost as failed:
                lost = failed
        g = self.grpo
        g.prompt_epoch, g.prompt_position, g.skipped_prompts = ahead.before
        self._lost = lost
        return ahead, None

    def _take_ahead(self) -> bool:
        """The next batch sampled ahead (or restored from the checkpoint) made this step's, the slots behind it
        moved up, if one is."""
        if not self._slots or self._slots[0].rows == 0:
            return False
        for to, source in zip([self.rollout, *self._slots], [*self._slots, RolloutBatch()]):
            for name in _BATCH_FIELDS:
                setattr(to, name, getattr(source, name))
        return True

    def _kept(self) -> tuple[dict[str, Any], list[tuple[RolloutBatch, list[Any]]]]:
        """The counters and the batches as a step begins (what a new rollout replaces, never changes in place)."""
        batches = (self.rollout, *self._slots)
        return self.grpo.state_dict(), [(b, [getattr(b, n) for n in _BATCH_FIELDS]) for b in batches]

    def _put_back(self, kept: tuple[dict[str, Any], list[tuple[RolloutBatch, list[Any]]]]) -> None:
        counters, batches = kept
        self.grpo.load_state_dict(counters)
        for batch, values in batches:
            for name, value in zip(_BATCH_FIELDS, values):
                setattr(batch, name, value)

    def _check_slots(self) -> None:
        """A checkpoint's batches sampled ahead fill the first slots, in the order they were sampled."""
        steps = [slot.step for slot in self._slots if slot.rows]
        if any(slot.rows == 0 for slot in self._slots[:len(steps)]) or steps != sorted(set(steps)):
            raise CheckpointError(f"the GRPO batches sampled ahead (next_rollout, next_rollout_2, ...) are not the "
                                  f"first slots in sampling order (rollout batches {steps})")

    def _engine_metrics(self) -> dict[str, Any]:
        """The weights that sampled the rollout batch: version, lag, hashes, and this step's push."""
        metrics: dict[str, Any] = {"weight_version": self.rollout.weight_version}
        if self.engine is None:
            return metrics
        sync = self._sync or Sync("", "", 0, 0.0)
        step = time.perf_counter() - self._train_start + self._generation_seconds + sync.sync_seconds
        metrics |= {"weight_lag": self.grpo.ppo_optimization_step - 1 - self.rollout.weight_version,
                    "weight_hash": self.rollout.weight_hash,
                    "engine_weight_hash": self.rollout.engine_hash or self.rollout.weight_hash,  # restored: checked
                    "sync_bytes": sync.sync_bytes, "sync_seconds": round(sync.sync_seconds, 6),
                    "sync_ratio": round(sync.sync_seconds / step, 6) if step > 0 else 0.0}
        return metrics
