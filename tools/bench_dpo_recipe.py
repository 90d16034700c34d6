"""The preference recipe as ``tools/bench_dpo.py`` runs it: unchanged, plus each rank's peak memory at the end
(written as ``tools/bench_train_recipe.py`` writes it)."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch

from automodel_ckpt.recipes.dpo import DPORecipe


class PeakMemoryDPORecipe(DPORecipe):
    """``DPORecipe``, recording the process's peak memory after its run."""

    def run(self) -> None:
        super().run()
        record = {"rank": self.env.rank,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
        if torch.cuda.is_available() and self.env.device.type == "cuda":
            record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        (Path(os.environ["BENCH_TRAIN_OUT"]) / f"rank{self.env.rank}.json").write_text(json.dumps(record))
