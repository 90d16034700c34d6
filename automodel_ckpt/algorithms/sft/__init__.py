"""Supervised fine-tuning, the default algorithm: no section of its own (``algorithm``)."""
