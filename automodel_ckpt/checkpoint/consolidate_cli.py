"""Compatibility entry point: ``consolidate.sh`` files of checkpoints written by 0.1.0 run this module.

It runs ``ckpt-train consolidate`` (``automodel_ckpt.cli.consolidate``) with the same arguments.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from automodel_ckpt.cli.consolidate import script_main

    sys.exit(script_main())
