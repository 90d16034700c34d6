"""The fine-tuning recipe as ``tools/bench_train.py`` runs it: unchanged, plus each rank's peak memory at the end.

``ckpt-train RECIPE --recipe tools/bench_train_recipe.py:PeakMemoryRecipe`` trains exactly as the default recipe
does; when the run ends, every rank writes ``$BENCH_TRAIN_OUT/rank<R>.json`` with its peak resident memory
(``ru_maxrss``) and, on CUDA, ``torch.cuda.max_memory_allocated``. The step times come from the run's own
``training.jsonl`` (``step_seconds``).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch

from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe


class PeakMemory:
    """A recipe mixin: after the recipe's run, this rank's peak memory in ``$BENCH_TRAIN_OUT/rank<R>.json``."""

    def run(self) -> None:
        super().run()
        record = {"rank": self.env.rank,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
        if torch.cuda.is_available() and self.env.device.type == "cuda":
            record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        out = Path(os.environ["BENCH_TRAIN_OUT"])
        (out / f"rank{self.env.rank}.json").write_text(json.dumps(record))


class PeakMemoryRecipe(PeakMemory, FinetuneRecipe):
    """``FinetuneRecipe``, recording the process's peak memory after its run."""
