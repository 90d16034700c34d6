"""The preference recipe with a fault at a chosen save (the pipeline-stage tests)."""

from __future__ import annotations

from automodel_ckpt.recipes.dpo import DPORecipe
from tests.integration.recipes_for_tests import CrashDuringSaveRecipe


class CrashDuringSaveDPORecipe(CrashDuringSaveRecipe, DPORecipe):
    """``CrashDuringSaveRecipe`` for a preference run: SIGKILL in the middle of the save of ``CRASH_AT_STEP``."""
