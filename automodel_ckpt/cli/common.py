"""What every `ckpt-train` verb shares: its argument parser, --debug, one-line error output and size format."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NamedTuple

from automodel_ckpt.errors import UsageError
from automodel_ckpt.launch import ERRORS_FOLDER
from automodel_ckpt.sizes import human_size  # noqa: F401 - every verb prints sizes this one way


class VerbParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for one verb: ``--debug`` always; bad arguments raise ``UsageError`` (one line, exit 2)."""

    def __init__(self, verb: str, description: str) -> None:
        super().__init__(prog=f"ckpt-train {verb}", description=description)
        self.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")

    def error(self, message: str) -> None:  # type: ignore[override]
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UsageError(f"{message} (usage: {usage})")


def debug_requested(argv: list[str]) -> bool:
    """``--debug`` anywhere on the command line, or ``AUTOMODEL_CKPT_DEBUG=1`` (inherited by worker processes)."""
    return "--debug" in argv or os.environ.get("AUTOMODEL_CKPT_DEBUG") == "1"


def report(message: str, origin: int | None = None) -> None:
    """Print ``message`` to stderr, prefixed with the rank on every rank but 0. Under the launcher each worker
    leaves it in the launcher's folder instead (rank 0 prints it too), and the launcher prints each other rank's
    line only where it differs from what was printed: an error every rank meets reads as one line. ``origin``: the
    rank the error came from (``distributed.collective``), which the launcher names whichever rank exits first."""
    rank = os.environ.get("RANK")
    folder = os.environ.get(ERRORS_FOLDER)  # set by the launcher (launch.other_ranks_errors)
    if folder and rank is not None and rank.isdigit():
        try:
            with open(os.path.join(folder, f"rank-{int(rank)}"), "a", encoding="utf-8") as f:
                f.write(message.replace("\n", " ") + "\n")
            if origin is not None:
                with open(os.path.join(folder, f"origin-{int(rank)}"), "w", encoding="utf-8") as f:
                    f.write(str(origin))
            if rank != "0":
                return
        except OSError:  # the folder is gone: the line goes to the stream as usual
            pass
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    sys.stderr.write(f"{prefix}{message}\n")  # one write: the ranks share the stream, so lines never run together
    sys.stderr.flush()


def load_recipe(path: Any, overrides: Any) -> Any:
    """A recipe file plus overrides, loaded with every algorithm's section (importing ``algorithms`` registers
    them; their dataclasses import neither torch nor ``datasets``)."""
    import automodel_ckpt.algorithms  # noqa: F401 - registers the algorithms' sections
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig

    return load_config(path, overrides, RecipeConfig)


def check_recipe(cfg: Any, world_size: int, *, inputs: bool = True, fetchable: bool = False) -> Checked:
    """Every check of a loaded recipe before training (``config.validate``, ``data.checks``; with ``inputs``, that its
    model, tokenizer and dataset paths exist): the mesh and one line per input saying where it lies. ``fetchable``
    (``--dry-run``): inputs only missing from the Hugging Face cache are said, not errors."""
    from automodel_ckpt.config.stages import StagePlan
    from automodel_ckpt.config.validate import check_inputs_exist, validate_config
    from automodel_ckpt.data import check_data_section, check_dataset_paths

    def values(staged: Any) -> None:
        validate_config(staged, world_size)
        check_data_section(staged)

    mesh = validate_config(cfg, world_size)
    check_data_section(cfg)
    plan = StagePlan.of(cfg)  # a run in stages: each stage's recipe checked as the recipe is (docs/stages.md)
    staged = [] if plan is None else [plan.config(i) for i in range(1, len(plan.stages))]
    if plan is not None:
        plan.check(values)

    if not inputs:
        return Checked(mesh, [])
    found = check_inputs_exist(cfg, fetchable=fetchable)
    for each in [cfg, *staged]:
        found += [line for line in check_dataset_paths(each, fetchable=fetchable) if line not in found]
    return Checked(mesh, found)


class Checked(NamedTuple):
    """What ``check_recipe`` found: the mesh (``distributed.mesh.MeshSizes``) and where each input lies."""

    mesh: Any
    inputs: list[str]
