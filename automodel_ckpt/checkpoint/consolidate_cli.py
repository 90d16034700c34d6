"""Compatibility entry point: ``consolidate.sh`` files of checkpoints written by 0.1.0 run this module.

It runs ``automodel_ckpt.cli.consolidate`` as ``python -m`` would: the engine imports nothing of the verbs.
"""

from __future__ import annotations

import runpy

VERB_MODULE = "automodel_ckpt.cli.consolidate"

if __name__ == "__main__":
    runpy.run_module(VERB_MODULE, run_name="__main__", alter_sys=True)
