"""Datasets (built-in, local files, the Hugging Face cache), cached tokenization into rows, preview, and the loaders.

The face of the package: code outside it imports the names below. They load on first use, so the launcher checks
a recipe's data section (``check_data_section``) without importing ``datasets``. Every training loader keeps one
contract, ``BatchLoader`` (``contract``): the map-style ``GlobalBatchLoader`` over tokenized rows, and the
streamed loader that ``build_streamed`` makes for a corpus read as the steps need it (``stream/``).
"""

from __future__ import annotations

from automodel_ckpt.faces import lazy_members

# name -> (module below this package, its name there)
_EXPORTS = {
    # the loaders: one contract
    "BatchLoader": ("contract", "BatchLoader"),
    "GlobalBatchLoader": ("loader", "GlobalBatchLoader"),
    "MicroBatch": ("loader", "MicroBatch"),
    "validation_batches": ("loader", "validation_batches"),
    "build_streamed": ("stream.build", "build_streamed"),
    "streamed_validation": ("stream.build", "streamed_validation"),
    "is_streamed": ("stream.corpus", "is_streamed"),
    # rows: tokenized supervised data and preference pairs
    "IGNORE_INDEX": ("tokenize", "IGNORE_INDEX"),
    "TokenizedData": ("tokenize", "TokenizedData"),
    "prepare_data": ("pipeline", "prepare_data"),
    "PairData": ("pairs", "PairData"),
    "pair_batches": ("pairs", "pair_batches"),
    "prepare_pairs": ("pairs", "prepare_pairs"),
    # checks made before training, previews, the built-in tasks' held-out examples
    "check_data_section": ("checks", "check_data_section"),
    "check_dataset_paths": ("checks", "check_dataset_paths"),
    "heldout_examples": ("builtin", "heldout_examples"),
    "heldout_vqa_examples": ("shapes", "heldout_vqa_examples"),
    "addition_problems": ("builtin", "problems"),
    # what `ckpt-train preview` shows: rows, pairs, a stream's first sequences, a rank's first ids
    "prepare_to_show": ("preview", "prepare_to_show"),
    "preview_rows": ("preview", "preview"),
    "preview_pairs": ("preview", "preview_pairs"),
    "preview_stream": ("stream.preview", "preview_stream"),
    "first_ids": ("stream.preview", "first_ids"),
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_members(__name__, _EXPORTS, globals())
