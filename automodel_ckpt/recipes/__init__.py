"""Recipes: classes that build the model, data and optimizer from a config and own the training loop.

A custom recipe subclasses ``BaseRecipe`` (constructor takes the config, ``run()`` trains); see
docs/custom-recipes.md.
"""

from automodel_ckpt.recipes.base import BaseRecipe

__all__ = ["BaseRecipe"]
