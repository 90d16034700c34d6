"""Recipes: classes that build the model, data and optimizer from a config and own the training loop.

A custom recipe subclasses ``BaseRecipe`` (constructor takes the config, ``run()`` trains); see
docs/custom-recipes.md.
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# imported on first use: the launcher checks that a recipe module exists (importing this package) without the
# training stack that BaseRecipe brings
_EXPORTS = exports_of({"base": "BaseRecipe"})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
