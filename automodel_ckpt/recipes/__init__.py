"""Recipes: classes that build the model, data and optimizer from a config and own the training loop.

A custom recipe subclasses ``BaseRecipe`` (constructor takes the config, ``run()`` trains); see
docs/custom-recipes.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BaseRecipe"]


def __getattr__(name: str) -> Any:
    # imported on first use: the launcher checks that a recipe module exists (importing this package) without the
    # training stack that BaseRecipe brings
    if name == "BaseRecipe":
        from automodel_ckpt.recipes.base import BaseRecipe

        return BaseRecipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
