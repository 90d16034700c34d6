"""Online RL (GRPO): its section (``config``), its prompts and rollout state (``state``) and algorithm."""
