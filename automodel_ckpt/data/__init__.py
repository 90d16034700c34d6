"""Datasets: local files and the built-in task, tokenization, and a resumable global-position loader."""
