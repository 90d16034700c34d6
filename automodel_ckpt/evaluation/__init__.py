"""Choosing checkpoints by what users measure: `ckpt-train eval` (lm-evaluation-harness) and `ckpt-train average`.

``tensors`` reads one model's tensors one at a time and ``folder`` writes a Hugging Face folder the same way;
``average`` and ``harness`` build on them. ``during_training`` scores the live weights, ``tracked`` logs `eval`'s
scores to the run's trackers, ``tasks/`` holds the task definitions the product ships. docs/evaluation.md.
"""
