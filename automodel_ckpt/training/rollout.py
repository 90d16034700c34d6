"""Online RL's pure parts: seeded per-completion sampling with a KV cache, group advantages, the clipped loss."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable, Sequence

import torch

from automodel_ckpt.distributed.tensor_parallel import causal_lm
from automodel_ckpt.training.rewards import RewardError

#: A label left out of the loss (the data package's ``IGNORE_INDEX``).
IGNORE = -100


def sample_seed(seed: int, rollout: int, prompt_id: int, index: int) -> int:
    """One completion's seed, from (run seed, rollout step, prompt id, sample index) only: no batching changes it."""
    digest = hashlib.sha256(f"grpo/{seed}/{rollout}/{prompt_id}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _forward_names(model: Any) -> set[str]:
    """The keywords the model's own forward names (a PEFT model's base model's: PEFT passes keywords through)."""
    try:
        return set(inspect.signature(type(causal_lm(model)).forward).parameters)
    except (TypeError, ValueError):
        return set()


def _cache_key(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by (transformers 5 renamed ``past_key_values`` ``cache``)."""
    return "cache" if "cache" in _forward_names(model) else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _pick(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each row's token by inverse CDF with that row's own uniform (greedy at temperature 0)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits.double()  # in place from here: a large vocabulary's rows are tens of megabytes per new token
    if temperature != 1.0:  # x / 1.0 is x
        scaled.div_(temperature)
    cdf = torch.softmax(scaled, dim=-1).cumsum_(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_max(logits.shape[-1] - 1)


def _keep_key(model: Any) -> str | None:
    """The keyword by which a model's forward computes logits for the last positions only (``logits_to_keep``), if
    it takes one: a prompt's other positions need none, and a large vocabulary's logits for them are gigabytes."""
    return "logits_to_keep" if "logits_to_keep" in _forward_names(model) else None


@torch.no_grad()
def generate(model: Any, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, max_new_tokens: int,
             temperature: float, eos_id: int | None, pad_id: int, device: Any = "cpu",
             keep_going: Callable[[bool], bool] | None = None) -> list[list[int]]:
    """Completions of ``prompts``, one per seed, on the model's KV cache, each row's uniforms from its own generator,
    ending at ``eos_id`` (kept) or ``max_new_tokens``; ``keep_going(done)``: whether to step again (a sharded
    forward is collective: every rank steps together)."""
    rows = len(prompts)
    if rows == 0 and keep_going is None:
        return []
    width = max((len(p) for p in prompts), default=1)
    ids = torch.full((max(rows, 1), width), pad_id, dtype=torch.long)
    mask = torch.zeros((max(rows, 1), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    if rows == 0:
        mask[0, -1] = 1  # a rank with nothing to sample still steps with the others
    uniforms = torch.zeros((len(ids), max_new_tokens), dtype=torch.float64)
    for i, s in enumerate(seeds):
        uniforms[i] = torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    key, keep = _cache_key(model), _keep_key(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **({keep: 1} if keep else {}))
    past, logits = _cache_of(out), out.logits[:, -1]
    last = positions[:, -1]
    done = torch.zeros(len(ids), dtype=torch.bool)
    done[rows:] = True
    drawn: list[torch.Tensor] = []  # each step's tokens
    taken: list[torch.Tensor] = []  # each step: the rows still going (their token is part of the completion)
    for step in range(max_new_tokens):
        tokens = _pick(logits.float().cpu(), uniforms[:, step], temperature)
        drawn.append(tokens)
        taken.append(~done)
        if eos_id is not None:
            done = done | (tokens == eos_id)
        if step == max_new_tokens - 1:
            break
        finished = bool(done.all())
        if not (keep_going(finished) if keep_going is not None else not finished):
            break
        mask = torch.cat([mask, torch.ones((len(ids), 1), dtype=mask.dtype, device=mask.device)], dim=1)
        last = last + 1
        out = model(input_ids=tokens.masked_fill(done, pad_id).unsqueeze(1).to(device), attention_mask=mask,
                    position_ids=last.unsqueeze(1), use_cache=True, **{key: past})
        past, logits = _cache_of(out), out.logits[:, -1]
    if not drawn:
        return [[] for _ in range(rows)]
    tokens_by_row = torch.stack(drawn, dim=1)[:rows].tolist()
    kept_by_row = torch.stack(taken, dim=1)[:rows].tolist()
    return [[t for t, k in zip(ts, ks) if k] for ts, ks in zip(tokens_by_row, kept_by_row)]


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """Each completion's reward less its group's mean, over its std (+ ``eps``); a group is ``group`` rows."""
    grouped = rewards.double().view(-1, group)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean)
    return ((grouped - mean) / (std + eps)).view(-1)


def group_shares(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each completion's reward as its share of its group's total (0 where the total is 0): every group that holds
    a rewarded completion weighs 1 in all, however many of its completions are rewarded. Rewards must be >= 0."""
    grouped = rewards.double().view(-1, group)
    total = grouped.sum(dim=1, keepdim=True)
    return torch.where(total > 0, grouped / total.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.zeros_like(grouped)).view(-1)


ADVANTAGES = {"normalized": group_advantages, "share": group_shares}  # grpo.advantage


def advantages(kind: str, rewards: torch.Tensor, group: int, names: list[str]) -> torch.Tensor:
    """``grpo.advantage`` ``kind`` of the weighted ``rewards``; shares need rewards >= 0 (``RewardError``)."""
    if kind == "share" and bool((rewards < 0).any()):
        raise RewardError(f"grpo.advantage share: a completion's weighted reward is {float(rewards.min()):g}; the "
                          f"reward functions ({', '.join(names)}) must give >= 0, or use grpo.advantage normalized")
    return ADVANTAGES[kind](rewards, group)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[rows, L]``: at position j the log-prob of label j given the tokens before it (0 where left out, and at 0)."""
    labels = labels.long()
    target = labels[:, 1:]
    keep = target != IGNORE
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1) * keep
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def clipped_loss(logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
                 keep: torch.Tensor, *, epsilon: float, epsilon_high: float | None = None,
                 beta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's per-token loss summed over the kept tokens, and ``[tokens, clipped, kl]``: ``-min(r A, clip(r, 1-eps,
    1+eps_high) A) + beta * k3``, ``r = exp(logp - old)``, ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's)."""
    keep = keep.to(logp.dtype)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old)
    adv = advantages.unsqueeze(1).to(logp.dtype)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp)
    if ref is not None and beta:
        delta = ref - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    was_clipped = (clipped < unclipped).to(logp.dtype)
    sums = torch.stack([keep.sum(), (was_clipped * keep).sum(), (kl * keep).sum()]).detach().double()
    return (per_token * keep).sum(), sums
