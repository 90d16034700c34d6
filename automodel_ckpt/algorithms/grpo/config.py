"""The ``grpo:`` section: its keys and their checks before training, registered as a section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from automodel_ckpt.config.sections import AlgorithmSection
from automodel_ckpt.errors import ConfigError


ENGINES = ("transformers", "vllm")  # grpo.engine
MAX_STALENESS = 8  # grpo.max_staleness: rollout batches held ahead at most (each is in every checkpoint)


def _default_rewards() -> List[Any]:
    return ["automodel_ckpt.training.rewards.exact_answer", "automodel_ckpt.training.rewards.digits_then_eos"]


@dataclass
class VLLMSettings:
    """``grpo.vllm``: where the engine of ``grpo.engine: vllm`` runs (docs/rl.md, Engine)."""

    python: Optional[str] = None  # the vLLM environment's Python (null: .venv-vllm/bin/python, here or the checkout's)
    url: Optional[str] = None  # an engine already serving (vllm_server.py): used, not started or stopped
    timeout: float = 600.0  # seconds the engine may take to start, or to answer one request


@dataclass
class GRPOConfig:
    """Online RL with group-relative advantages (docs/rl.md): sampling, rewards and the clipped loss."""

    num_generations: int = 4  # completions per prompt (a group); global_batch_size counts completions
    max_new_tokens: int = 8  # a completion's longest length (it ends earlier at end of sequence)
    temperature: float = 1.0  # sampling temperature (0: greedy)
    num_iterations: int = 1  # optimizer steps (passes) over each rollout batch (mu)
    epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # the upper clip (null: epsilon)
    beta: float = 0.0  # per-token k3 KL penalty to the reference (0: no reference is kept)
    reward_funcs: List[Any] = field(default_factory=_default_rewards)  # dotted names, or {_target_: ..., keyword: value}
    reward_weights: Optional[List[float]] = None  # one per reward function (null: each 1.0)
    advantage: str = "normalized"  # normalized: (reward - group mean) / group std; share: reward / group total (>= 0)
    prompt_field: str = "prompt"  # the prompt column (a string)
    answer_field: str = "completion"  # the reference answer column, handed to the reward functions
    engine: str = "transformers"  # what samples: transformers (the training model, in process) or vllm (a server)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    max_staleness: int = 0  # 0: synchronous; K: rollout batches sampled (vllm) K optimizer steps ahead of training


def check_section(section: Any, global_batch: int, pp_size: int) -> None:
    """The ``grpo:`` keys against the batch and the mesh, each problem in one line (``ConfigError``)."""
    if pp_size > 1:
        raise ConfigError("distributed.pp_size: GRPO samples completions with the whole model on every rank; "
                          "pipeline stages are not supported, use pp_size 1")
    g = section.num_generations
    if g < 1 or global_batch % g:
        raise ConfigError(f"grpo.num_generations: {g} must be >= 1 and divide step_scheduler.global_batch_size "
                          f"({global_batch} completions per rollout)")
    if section.num_iterations < 1 or section.max_new_tokens < 1:
        raise ConfigError("grpo.num_iterations and grpo.max_new_tokens must be >= 1")
    if section.beta < 0 or section.epsilon < 0 or section.temperature < 0:
        raise ConfigError("grpo.beta, grpo.epsilon and grpo.temperature must be >= 0")
    from automodel_ckpt.training.rollout import ADVANTAGES

    if section.advantage not in ADVANTAGES:
        raise ConfigError(f"grpo.advantage: {section.advantage!r} is not one of {', '.join(ADVANTAGES)}")
    if section.engine not in ENGINES:
        raise ConfigError(f"grpo.engine: {section.engine!r} is not one of {', '.join(ENGINES)}")
    if section.engine == "vllm" and section.vllm.timeout <= 0:
        raise ConfigError("grpo.vllm.timeout must be > 0 seconds")
    if not 0 <= section.max_staleness <= MAX_STALENESS:
        raise ConfigError(f"grpo.max_staleness: {section.max_staleness} is not 0 (synchronous) to {MAX_STALENESS} "
                          "(rollout batches sampled that many optimizer steps ahead)")
    if section.max_staleness and (section.engine != "vllm" or section.num_iterations != 1 or section.beta != 0):
        raise ConfigError(f"grpo.max_staleness {section.max_staleness} needs grpo.engine vllm (it samples while the "
                          "trainer trains), grpo.num_iterations 1 and grpo.beta 0")
    if section.advantage == "share" and any(w < 0 for w in (section.reward_weights or ())):
        raise ConfigError("grpo.reward_weights: share advantages need weights >= 0 (a reward's share of its group's "
                          "total); use grpo.advantage normalized for negative weights")


SECTION = AlgorithmSection("grpo", GRPOConfig, "online RL keys (recipe: automodel_ckpt.recipes.grpo.GRPORecipe)",
                           check=lambda cfg, sizes: check_section(cfg.grpo, cfg.step_scheduler.global_batch_size,
                                                                  sizes.pp),
                           no_stages="an online RL run (grpo:) keeps its rollout batch across steps; it "
                           "takes no stages yet (docs/stages.md)")
