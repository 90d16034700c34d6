"""Causal LMs from a local Hugging Face folder or a config block, and the embedded tiny base model."""
