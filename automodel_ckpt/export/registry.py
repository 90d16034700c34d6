"""The export targets, by name: each is one module of this package, registered here by one line.

A target that needs a layer above ``export/`` (``--to hf-trainer`` builds the run's recipe in the CLI) is added
with ``register_target(target)`` by the code that owns it.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.errors import UsageError
from automodel_ckpt.export import gguf_target, int8_target
from automodel_ckpt.export.target import ExportTarget
from automodel_ckpt.registry import Registry

_TARGETS: Registry[ExportTarget] = Registry("an export target", lambda name, names: UsageError(
    f"--to: expected one of {', '.join(names)}, got '{name}'"))


def register_target(target: ExportTarget) -> ExportTarget:
    """Add ``target`` (an ``ExportTarget`` with its ``name``); registering a name again replaces its target."""
    return _TARGETS.register(target)


def unregister_target(name: str) -> None:
    _TARGETS.unregister(name)


register_target(gguf_target.TARGET)
register_target(int8_target.TARGET)

#: ``--to``'s value when none is given
DEFAULT_TARGET = gguf_target.NAME


def target_names() -> list[str]:
    return _TARGETS.names()


def get_target(name: str) -> ExportTarget:
    """The target named ``name``; ``UsageError`` naming the ones there are otherwise."""
    return _TARGETS.get(name)


def export_targets() -> list[ExportTarget]:
    return list(_TARGETS)


def identify(path: Path) -> ExportTarget | None:
    """The target whose file ``path`` is (asked in registration order); None when it is no target's."""
    return _TARGETS.first(lambda t: t.identify(Path(path)))
