"""Recipes: classes that build the model, data and optimizer from a config and own the training loop."""
