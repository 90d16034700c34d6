"""Datasets (built-in, local files, the Hugging Face cache), cached tokenization into rows, preview, and a resumable global-position loader."""
