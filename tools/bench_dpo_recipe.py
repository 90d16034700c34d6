"""The preference recipe as ``tools/bench_dpo.py`` runs it: unchanged, plus each rank's peak memory at the end
(``tools/bench_train_recipe.py``'s ``PeakMemory``)."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.config.instantiate import locate
from automodel_ckpt.recipes.dpo import DPORecipe

PeakMemory = locate(f"{Path(__file__).resolve().parent / 'bench_train_recipe.py'}:PeakMemory")


class PeakMemoryDPORecipe(PeakMemory, DPORecipe):
    """``DPORecipe``, recording the process's peak memory after its run."""
