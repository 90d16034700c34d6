"""The checkpoint engine: what to save (discovered state), saving, restoring, where run folders live; its public face.

``Checkpointer`` saves and restores a recipe's discovered state on every rank together; ``CheckpointConfig`` is the
``checkpoint:`` section (validated when made); ``discover_state`` finds what a recipe checkpoints. Below it the
engine's rooms: ``save/``, ``restore/``, ``storage/`` (a local folder, an object store, the node-local tier) and
``objectstore/`` (private to ``storage/``). What a checkpoint folder holds, byte for byte, is
``automodel_ckpt.ondisk``'s: the engine imports it, never the other way round.

Code outside this package and ``ondisk`` imports only the names below (``tests/unit/test_structure.py``). The
names load on first use, so light modules (``config``, ``locations``) import without torch.
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module (one starting with "." is below this package) -> the names of its members that the face hands on
_EXPORTS = exports_of({
    ".checkpointer": "Checkpointer",
    ".triggers": "PreemptionWatcher AutoInterval",
    ".save_interval": "SaveInterval MTBF_LIMIT_HOURS",  # ckpt_every_steps: auto's schedule
    ".config": "CheckpointConfig ConsolidationMode LoadErrorPolicy ModelSaveFormat MonitorMode",
    ".state": "StatePlan discover_state plan_state",
    # what a save wrote (its types are the checkpoint folder's, in ondisk; named by this face alone)
    "automodel_ckpt.ondisk.info": "HFArtifacts SaveInfo WrittenBy",
    "automodel_ckpt.ondisk.metadata": "written_by",
    # where run folders live: URLs, the folder a run writes, reading any location, uploads
    ".locations": "is_url check_url",
    ".storage": "open_filesystem open_for_reading open_store_run run_folder share_run_file fetch_run_file source_of "
                "stored_files stored_sharing streamed_object upload_folder",
    ".storage.runlock": "RunLock release_all_locks",
    # weights into a model built elsewhere (a Hugging Face folder, sharded or not)
    ".restore.hf_weights": "load_hf_weights load_hf_folder in_memory_names local_part",
})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
