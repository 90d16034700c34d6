"""`python -m automodel_ckpt` runs the `ckpt-train` command."""

import sys

from automodel_ckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
