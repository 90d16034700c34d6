"""What an export target is: ``ExportTarget``, the object each target module registers, and the request it gets.

A target is what ``ckpt-train export --to NAME`` writes: its options, the export, and, where its output is one file
the other verbs meet, how that file is recognised, described, checked, compared and followed; no verb knows a
target by name. Every target keeps one invariant: SRC is only read, and the output appears whole (written beside
it, then renamed) or not at all; a bad SRC or option is one line (``UserError``), never a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel_ckpt.ondisk import Archive

if TYPE_CHECKING:
    from automodel_ckpt.export.model_source import ModelSource


@dataclass(frozen=True)
class ExportRequest:
    """One ``ckpt-train export`` call: its arguments (SRC, ``--out``, ``--dry-run``, ``--no-progress``, ``--recipe``,
    every target's own options; ``overrides``: the recipe's ``--section.key value`` overrides, for a target that
    takes them) and what the verb offers from the layers above ``export/``."""

    args: argparse.Namespace
    #: ``(recipe file, tokenizer, n)`` -> the token ids of the first ``n`` rows of that recipe's validation data
    #: (else its training data), tokenized as for training: only the CLI may build a user's recipe
    recipe_examples: Callable[[Path, Any, int], list[list[int]]] | None = None
    #: () -> the export's lineage record (SRC by path and fingerprint), for the target to write beside its output
    lineage: Callable[[], dict[str, Any]] | None = None

    @property
    def src(self) -> Path:
        return Path(self.args.src)

    def out(self, tail: str) -> Path:
        """``--out`` when given, else ``tail`` appended to SRC's name beside it (an archive's name without
        ``.tar``; a link keeps its own name)."""
        if self.args.out:
            return Path(self.args.out)
        where = self.src.absolute()
        return where.parent / f"{where.name.removesuffix(Archive.SUFFIX)}{tail}"


class ExportTarget:
    """One export target. Subclasses set ``name`` and ``summary`` and implement ``export``; a target whose output
    is one file the other verbs meet sets ``noun`` and ``suffix`` and implements ``identify``, ``describe``,
    ``render`` and ``verify`` too, and where it can, ``check``, ``lineage_text``, ``open_tensors`` and ``beside``."""

    name: str = ""  # ``--to``'s value
    summary: str = ""  # what it writes, in a few words (``export --help``)
    noun: str = ""  # one of its files, in words ("a ... file"), where it has a file kind of its own
    suffix: str = ""  # how the name of one of its files ends, where it has a file kind of its own
    takes_overrides: bool = False  # ``--section.key value`` overrides of ``--recipe`` may follow its arguments
    checks_other_options: bool = True  # the other targets' options given with this one are refused (``refuse``)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add its own options to the verb's parser (names no other target adds; ``--recipe`` is the verb's)."""

    def refuse(self, args: argparse.Namespace) -> None:
        """``UsageError`` for an option of its own given while another target was chosen."""

    def export(self, request: ExportRequest) -> int:
        """Write ``request``'s SRC as this target; the verb's exit code."""
        raise NotImplementedError

    def identify(self, path: Path) -> bool:
        """Whether ``path`` is one of its files (its magic checked, nothing else read)."""
        return False

    def describe(self, path: Path) -> dict[str, Any]:
        """What the file holds, as plain JSON-ready values (``inspect --json``)."""
        raise NotImplementedError(f"export target '{self.name}' has no file to describe")

    def render(self, info: dict[str, Any]) -> str:
        """``describe``'s values in a few lines (``inspect``)."""
        raise NotImplementedError(f"export target '{self.name}' has no file to describe")

    def verify(self, path: Path, *, decode: bool) -> bool:
        """Check the file and print its report (``verify``; ``decode`` off: sizes only); whether it is whole."""
        raise NotImplementedError(f"export target '{self.name}' has no file to verify")

    def check(self, path: Path, consequence: str) -> None:
        """A one-line ``CheckpointError`` ending in ``consequence`` when the file is damaged (``pack`` ships only a
        whole one); quiet otherwise."""

    def lineage_text(self, path: Path, limit: int) -> str | None:
        """The lineage record an export wrote into the file (JSON text of at most ``limit`` bytes), or None."""
        return None

    def open_tensors(self, path: Path, stack: ExitStack) -> ModelSource:
        """The file's tensors by its own names, open until ``stack`` closes (``diff`` of two such files)."""
        raise NotImplementedError(f"export target '{self.name}' has no file to compare")

    def beside(self, model: ModelSource, path: Path, stack: ExitStack) -> tuple[ModelSource, ModelSource]:
        """``model`` as this target lays it out, and the file ``path``, both under ``model``'s names (``diff``)."""
        raise NotImplementedError(f"export target '{self.name}' has no file to compare")
