"""Experiment tracking (TensorBoard, MLflow, Weights & Biases) and what checkpoints cost the run."""

from automodel_ckpt.tracking.costlog import CheckpointCosts, read_events, summarize
from automodel_ckpt.tracking.costreport import cost_report, one_line
from automodel_ckpt.tracking.observer import RunObserver
from automodel_ckpt.tracking.tracker import RunTracker, checkpoint_metrics, train_metrics, validation_metrics

__all__ = ["CheckpointCosts", "RunObserver", "RunTracker", "checkpoint_metrics", "cost_report", "one_line", "read_events",
           "summarize", "train_metrics", "validation_metrics"]
