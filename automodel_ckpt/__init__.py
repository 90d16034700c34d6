"""automodel-ckpt: a YAML-driven LLM fine-tuning trainer built around exact, crash-safe checkpoints."""

__version__ = "0.1.0"
