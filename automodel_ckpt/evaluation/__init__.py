"""Choosing checkpoints by what users measure: `ckpt-train eval` (lm-evaluation-harness) and `ckpt-train average`.

``tensors`` reads one model's tensors (a checkpoint of any world size and format, an export folder, an archive or a
LoRA adapter) one at a time without consolidating it first, through ``automodel_ckpt.ondisk``'s readers;
``folder`` writes a Hugging Face folder tensor by tensor; ``average`` is the streamed mean of several models;
``harness`` builds the model of one checkpoint and runs the harness on it through the harness's own HF model class;
``during_training`` scores the live weights at the ``evaluation:`` section's steps; ``tracked`` puts `eval`'s
scores on the checkpoint's run's trackers; ``tasks/`` holds the harness task definitions the product ships
(``addition``: the embedded recipe's task).
"""
