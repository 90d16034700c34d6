"""Every byte format a checkpoint holds: sharded model and optimizer state, PEFT adapters, safetensors, pickles.

Each module is imported where it is used; the package re-exports nothing. The model formats are plug-ins, one
module each, registered by one line of ``registry`` (``register``, ``get``, ``detect``, ``names``), each a
``base.ModelFormat``: ``safetensors_shards`` (per-rank Hugging Face safetensors shards), ``dcp_shards`` (DCP
``.distcp`` files, ``torch_save``) and ``adapter`` (a PEFT model's adapter folder). Beneath them: ``sharded``
(DCP saves and loads of model and optimizer state, through ``ondisk.fastio``, planned by ``ondisk.saveplan``),
``peft`` (adapter folders), ``pieces`` (a folder's tensors as pieces of files, for the export), ``safetensors_io``
(headers and slices), ``safe_load`` (the only reader of pickles), ``detect`` (which format a folder holds) and
``family`` (a model family's on-disk tensor layout). Formats only: the I/O engine and the save planning live beside
this package.
"""
