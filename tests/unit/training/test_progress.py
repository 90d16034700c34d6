"""The progress bar: the loss, an algorithm's own numbers (GRPO's reward, DPO's accuracy), the lr."""

from __future__ import annotations

from automodel_ckpt.algorithms.dpo.algorithm import Preference
from automodel_ckpt.algorithms.grpo.algorithm import GRPO
from automodel_ckpt.algorithms.sft.algorithm import Supervised
from automodel_ckpt.algorithms.dpo.losses import METRICS
from automodel_ckpt.training.progress import Progress


def test_the_bar_shows_the_algorithms_numbers_between_the_loss_and_the_lr():
    bar = Progress(4, enabled=True)
    bar.start(0)
    try:
        bar.update(1, 0.5, 1e-3, {"reward": 0.25})
        assert bar._bar.postfix == "loss=0.5000 reward=0.2500 lr=1.00e-03" and bar._bar.n == 1
        bar.update(2, 0.25, 2e-3)
        assert bar._bar.postfix == "loss=0.2500 lr=2.00e-03" and bar._bar.n == 2
    finally:
        bar.close()


def test_each_algorithm_shows_numbers_it_logs():
    assert Supervised.bar_metrics == ()
    assert GRPO.bar_metrics == ("reward",)  # a key of every GRPO step's record (tests/integration/test_grpo.py)
    assert set(Preference.bar_metrics) <= set(METRICS[1:])  # what a DPO step records beside its loss
