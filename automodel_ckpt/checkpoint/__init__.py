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

from typing import TYPE_CHECKING

from automodel_ckpt.faces import lazy_members

# name -> (module, its name there); a module starting with "." is below this package
_EXPORTS = {
    "Checkpointer": (".checkpointer", "Checkpointer"),
    "PreemptionWatcher": (".triggers", "PreemptionWatcher"),
    "AutoInterval": (".triggers", "AutoInterval"),
    "CheckpointConfig": (".config", "CheckpointConfig"),
    "ConsolidationMode": (".config", "ConsolidationMode"),
    "LoadErrorPolicy": (".config", "LoadErrorPolicy"),
    "ModelSaveFormat": (".config", "ModelSaveFormat"),
    "MonitorMode": (".config", "MonitorMode"),
    "StatePlan": (".state", "StatePlan"),
    "discover_state": (".state", "discover_state"),
    "plan_state": (".state", "plan_state"),
    # what a save wrote (its types are the checkpoint folder's, in ondisk; named by this face alone)
    "HFArtifacts": ("automodel_ckpt.ondisk.info", "HFArtifacts"),
    "SaveInfo": ("automodel_ckpt.ondisk.info", "SaveInfo"),
    "WrittenBy": ("automodel_ckpt.ondisk.info", "WrittenBy"),
    "written_by": ("automodel_ckpt.ondisk.metadata", "written_by"),
    # where run folders live: URLs, the folder a run writes, reading any location, uploads
    "is_url": (".locations", "is_url"),
    "check_url": (".locations", "check_url"),
    "open_filesystem": (".storage", "open_filesystem"),
    "open_for_reading": (".storage", "open_for_reading"),
    "open_store_run": (".storage", "open_store_run"),
    "run_folder": (".storage", "run_folder"),
    "share_run_file": (".storage", "share_run_file"),
    "fetch_run_file": (".storage", "fetch_run_file"),
    "source_of": (".storage", "source_of"),
    "stored_files": (".storage", "stored_files"),
    "stored_sharing": (".storage", "stored_sharing"),
    "streamed_object": (".storage", "streamed_object"),
    "upload_folder": (".storage", "upload_folder"),
    "RunLock": (".storage.runlock", "RunLock"),
    "release_all_locks": (".storage.runlock", "release_all_locks"),
    # weights into a model built elsewhere (a Hugging Face folder, sharded or not)
    "load_hf_weights": (".restore.hf_weights", "load_hf_weights"),
    "load_hf_folder": (".restore.hf_weights", "load_hf_folder"),
    "in_memory_names": (".restore.hf_weights", "in_memory_names"),
    "local_part": (".restore.hf_weights", "local_part"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from automodel_ckpt.checkpoint.checkpointer import Checkpointer
    from automodel_ckpt.checkpoint.config import (CheckpointConfig, ConsolidationMode, LoadErrorPolicy, ModelSaveFormat,
                                                  MonitorMode)
    from automodel_ckpt.checkpoint.locations import check_url, is_url
    from automodel_ckpt.checkpoint.restore.hf_weights import (in_memory_names, load_hf_folder, load_hf_weights,
                                                              local_part)
    from automodel_ckpt.checkpoint.state import StatePlan, discover_state, plan_state
    from automodel_ckpt.checkpoint.triggers import AutoInterval, PreemptionWatcher
    from automodel_ckpt.checkpoint.storage import (fetch_run_file, open_filesystem, open_for_reading, open_store_run,
                                                   run_folder, share_run_file, source_of, stored_files,
                                                   stored_sharing, streamed_object, upload_folder)
    from automodel_ckpt.checkpoint.storage.runlock import RunLock, release_all_locks
    from automodel_ckpt.ondisk.info import HFArtifacts, SaveInfo, WrittenBy
    from automodel_ckpt.ondisk.metadata import written_by


__getattr__ = lazy_members(__name__, _EXPORTS, globals())
