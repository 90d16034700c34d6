"""Where the parts of an image-text model live: its vision tower and the projector that feeds the language model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PROJECTOR_NAMES", "VISION_TOWER_NAMES", "vision_tower", "vision_module_paths"]

#: Module names of the vision encoder (LLaVA and most others: ``vision_tower``; Qwen2-VL: ``visual``).
VISION_TOWER_NAMES: tuple[str, ...] = ("vision_tower", "visual")
#: Module names of the layers mapping image features into the language model's embedding space.
PROJECTOR_NAMES: tuple[str, ...] = ("multi_modal_projector",)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of an image-text model, or None for a text model."""
    return next((module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES),
                None)


def vision_module_paths(model: nn.Module, *, towers: bool = True, projectors: bool = True) -> list[str]:
    """Paths (as ``named_modules`` gives them) of the vision towers and/or projectors of ``model``."""
    names = (VISION_TOWER_NAMES if towers else ()) + (PROJECTOR_NAMES if projectors else ())
    return [path for path, _ in model.named_modules() if path and path.rsplit(".", 1)[-1] in names]
