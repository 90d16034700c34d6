"""Hugging Face export of checkpoints: the plan, shard sources, writer, atomic commit, HF metadata, LoRA merge."""
