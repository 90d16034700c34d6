"""Every byte format a checkpoint holds: sharded model and optimizer state, PEFT adapters, safetensors, pickles.

Each module is imported where it is used; the package re-exports nothing: ``sharded`` (DCP ``.distcp`` files
and per-rank Hugging Face safetensors shards), ``fastio`` (their parallel file I/O), ``peft`` (adapter folders),
``safetensors_io`` (headers and slices), ``safe_load`` (the only reader of pickles), ``detect`` (which format a
folder holds) and ``family`` (a model family's on-disk tensor layout).
"""
