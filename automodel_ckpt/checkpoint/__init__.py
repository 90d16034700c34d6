"""The checkpoint engine: what to save (discovered state), saving, restoring, where run folders live; its public face.

It imports ``ondisk``, never the other way round. Code outside imports only the names below, loaded on first use
(light modules import without torch).
"""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module (one starting with "." is below this package) -> the names of its members that the face hands on
_EXPORTS = exports_of({
    ".checkpointer": "Checkpointer",
    ".triggers": "PreemptionWatcher AutoInterval",
    ".save_interval": "SaveInterval MTBF_LIMIT_HOURS DEFAULT_MTBF_HOURS",  # ckpt_every_steps: auto's schedule
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
