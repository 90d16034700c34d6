#!/usr/bin/env python3
"""Export a training checkpoint's model to a Hugging Face folder (see automodel_ckpt.cli.consolidate).

    python tools/offline_hf_consolidation.py CHECKPOINT_OR_MODEL_DIR [--out DIR] [--cast-dtype bf16] ...
    torchrun --standalone --nproc-per-node 4 tools/offline_hf_consolidation.py CHECKPOINT ...
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a source tree without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel_ckpt.cli.consolidate import script_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(script_main())
