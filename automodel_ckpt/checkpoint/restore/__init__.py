"""What a run starts from and loading it: each tier of the restore chooses, ``loader`` loads a checkpoint.

Each module is imported where it is used; the package re-exports nothing: ``fallback`` (the one
choose-verify-fall-back loop over the tiers), ``resume`` (the durable tier: the newest checkpoint of the run's own
that loads, damaged ones quarantined), ``initial_weights`` (the weights-only start, ``load_only``: other weights,
asked after the durable tier), ``decision`` (what ``decide`` returns), ``probe`` (can it
load, is it this run's), ``loader`` (``CheckpointLoader``) and ``hf_weights`` (a Hugging Face folder or archive into
a sharded model, each rank reading its slices).
"""
