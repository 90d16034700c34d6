"""Experiment tracking (TensorBoard, MLflow, Weights & Biases) and what checkpoints cost the run; its public face.

Code outside this package imports only the names below (``tests/unit/test_structure.py``).
"""

from automodel_ckpt.tracking.annotate import annotate
from automodel_ckpt.tracking.costlog import CheckpointCosts, iter_events, summarize
from automodel_ckpt.tracking.costreport import cost_report, one_line
from automodel_ckpt.tracking.costreport import render as render_cost
from automodel_ckpt.tracking.interval import advise
from automodel_ckpt.tracking.observer import RunObserver
from automodel_ckpt.tracking.tracker import RunTracker, checkpoint_metrics, train_metrics, validation_metrics

__all__ = ["CheckpointCosts", "RunObserver", "RunTracker", "advise", "annotate", "checkpoint_metrics", "cost_report",
           "iter_events", "one_line", "render_cost", "summarize", "train_metrics", "validation_metrics"]
