"""Hugging Face export: how a checkpoint becomes a folder in the base model's own on-disk layout."""
