"""Writes ``consolidate.sh`` into a model folder: a one-command HF export that needs no knowledge of this package."""

from __future__ import annotations

import shlex
import sys
from importlib import resources
from pathlib import Path

from automodel_ckpt.ondisk import ModelFolder, write_atomic

_TEMPLATE = "templates/consolidate.sh"


def render_consolidate_script(model_dir: Path) -> None:
    """Write ``model_dir/consolidate.sh`` (mode 755) bound by default to this interpreter (the likeliest to have a
    compatible torch and transformers) and this copy of the package (a source tree too); the script falls back to
    ``python3`` when that path is gone, and honours ``PYTHON``."""
    model_dir = Path(model_dir)
    text = resources.files("automodel_ckpt.ondisk").joinpath(_TEMPLATE).read_text(encoding="utf-8")
    text = text.replace("@PYTHON@", shlex.quote(sys.executable or "python3"))
    text = text.replace("@PACKAGE_ROOT@", shlex.quote(_source_root()))
    target = ModelFolder(model_dir).consolidate_script
    write_atomic(target, text.encode("utf-8"))
    target.chmod(0o755)


def _source_root() -> str:
    """Folder holding ``automodel_ckpt`` when it runs from a source tree; empty when installed in site-packages."""
    root = Path(__file__).resolve().parents[2]
    if any(part in ("site-packages", "dist-packages") for part in root.parts):
        return ""
    return str(root)
