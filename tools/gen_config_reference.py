"""Writes docs/config-reference.md from the config schema: python tools/gen_config_reference.py"""

from pathlib import Path

import automodel_ckpt.algorithms  # noqa: F401 - registers the algorithms' sections, which the reference lists
from automodel_ckpt.config.reference import render_reference

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
    out.write_text(render_reference(), encoding="utf-8")
    print(f"wrote {out}")
