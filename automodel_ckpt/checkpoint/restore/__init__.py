"""What a run starts from and loading it: ``resume.decide`` returns a ``Decision``, ``loader`` carries it out.

Each module is imported where it is used; the package re-exports nothing: ``fallback`` (the one
choose-verify-fall-back loop over the tiers), ``resume`` (the durable tier: the newest checkpoint that loads,
damaged ones quarantined), ``decision`` (what ``decide`` returns and the ``Source`` it reads), ``probe`` (can it
load, is it this run's), ``loader`` (``CheckpointLoader``), ``initial_weights`` (``load_only``: other weights) and
``hf_weights`` (a Hugging Face folder into a sharded model, each rank reading its slices).
"""
