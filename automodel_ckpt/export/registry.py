"""The export targets, by name: each is one module of this package, registered here by one line.

``get_target(name)`` is ``ckpt-train export --to NAME``'s target, ``target_names()`` the values ``--to`` accepts
(in registration order), ``identify(path)`` the target whose file ``path`` is (``inspect``, ``verify``). A target
from outside the package (one that needs a layer above ``export/``, as ``--to hf-trainer`` builds the run's recipe
in the CLI) is added with ``register_target(target)`` by the code that owns it.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.errors import UsageError
from automodel_ckpt.export import gguf_target, int8_target
from automodel_ckpt.export.target import ExportTarget

_TARGETS: dict[str, ExportTarget] = {}


def register_target(target: ExportTarget) -> ExportTarget:
    """Add ``target`` (an ``ExportTarget`` with its ``name``); registering a name again replaces its target."""
    if not target.name or not isinstance(target.name, str) or target.name.startswith("-"):
        raise ValueError(f"an export target needs a name, got {target!r}")
    _TARGETS[target.name] = target
    return target


def unregister_target(name: str) -> None:
    """Remove the target ``name`` (a plug-in's, when it is done)."""
    _TARGETS.pop(str(name), None)


register_target(gguf_target.TARGET)
register_target(int8_target.TARGET)

#: ``--to``'s value when none is given
DEFAULT_TARGET = gguf_target.NAME


def target_names() -> list[str]:
    return list(_TARGETS)


def export_targets() -> list[ExportTarget]:
    return list(_TARGETS.values())


def get_target(name: str) -> ExportTarget:
    """The target named ``name``; ``UsageError`` naming the ones there are otherwise."""
    target = _TARGETS.get(str(name))
    if target is None:
        raise UsageError(f"--to: expected one of {', '.join(_TARGETS)}, got '{name}'")
    return target


def identify(path: Path) -> ExportTarget | None:
    """The target whose file ``path`` is (asked in registration order); None when it is no target's."""
    return next((t for t in _TARGETS.values() if t.identify(Path(path))), None)
