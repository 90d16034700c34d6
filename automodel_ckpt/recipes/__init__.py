"""Recipes: classes that build the model, data and optimizer from a config and own the training loop."""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# imported on first use: the launcher checks a recipe module exists without the training stack BaseRecipe brings
_EXPORTS = exports_of({"base": "BaseRecipe"})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
