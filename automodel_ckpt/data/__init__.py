"""Datasets (built-in, local files, the Hugging Face cache), cached tokenization into rows, preview, and the loaders.

The package's face; its names load on first use, so the launcher checks a recipe's data section without importing
``datasets``. Every training loader keeps one contract, ``BatchLoader``.
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module below this package -> the names of its members that the face hands on, each under its own name
_EXPORTS = exports_of({
    # the loaders: one contract
    "contract": "BatchLoader",
    "loader": "GlobalBatchLoader GlobalPosition MicroBatch validation_batches",
    "stream.build": "build_streamed streamed_validation",
    "stream.corpus": "is_streamed",
    # rows: tokenized supervised data and preference pairs
    "tokenize": "IGNORE_INDEX TokenizedData",
    "pipeline": "prepare_data prompt_columns",
    "pairs": "PairData pair_batches prepare_pairs",
    # checks made before training, previews, the built-in tasks' held-out examples
    "checks": "check_data_section check_dataset_paths",
    "builtin": "heldout_examples addition_problems",
    "shapes": "heldout_vqa_examples",
    # what `ckpt-train preview` shows: rows, pairs, a stream's first sequences, a rank's first ids
    "preview": "prepare_to_show preview_rows preview_pairs",
    "stream.preview": "preview_stream first_ids",
})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
