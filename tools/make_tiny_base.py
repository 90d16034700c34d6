"""Create the embedded tiny Llama base model folder (offline, reproducible): ``python tools/make_tiny_base.py OUT_DIR``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from automodel_ckpt.models.tiny import ensure_tiny_base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(":", 1)[0])
    parser.add_argument("out_dir", type=Path, help="folder to create; left untouched if it already holds a model")
    args = parser.parse_args(argv)
    folder = ensure_tiny_base(args.out_dir)
    sys.stdout.write(f"{folder}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
