"""The checkpoint folder and its bytes: the contract with every checkpoint on disk, and its one public face.

Everything a checkpoint folder holds is spelled and read here, versioned by ``layout.LAYOUT_VERSION``: file names,
limits on untrusted files, the path validator, metadata, the manifest and its checksums, durable writes, the
catalog, the byte formats (``formats/``), the I/O engine (``fastio/``) and DCP save planning (``saveplan/``). It
never imports the exports nor the engine that writes checkpoints (``checkpoint``). Code outside this package and
``checkpoint`` imports only the names below (``tests/unit/test_structure.py``), each a member of a module here under
its own name; for the exports they are their contract with the folder's bytes. The layout's files reach outside
code as folder objects (``CheckpointFolder(ckpt).model.consolidated.config``). Names load on first use, so reading
a run folder (``inspect``, ``verify``) imports no torch."""

from __future__ import annotations

from automodel_ckpt.faces import exports_of, lazy_members

# module below this package -> the names of its members that the face hands on
_EXPORTS = exports_of({
    # the run, checkpoint, model, Hugging Face and archive folders: their files' paths as properties
    "folders": "Archive CheckpointFolder HFFolder ModelFolder RunFolder old_sibling tmp_sibling",
    "bounded": "CONFIG_FILE_LIMIT INDEX_FILE_LIMIT LOG_LINE_LIMIT MAX_DEPTH SMALL_FILE_LIMIT MiB "
               "check_size is_count parse_json read_bytes read_json read_yaml yaml_depth_line "
               "COUNT_LIMIT MAX_WORLD_SIZE check_count",
    "paths": "check_path file_kind is_plain_name model_file_in open_regular path_inside regular_file_problem "
             "not_regular path_problem walk_regular",
    "catalog": "CheckpointRecord pointer_target pointer_targets quarantined_checkpoints scan_checkpoints size_on_disk",
    "manifest": "CHECKSUM_MISMATCH UNEXPECTED_FILE ManifestReport add_files_to_manifest read_manifest verify_manifest "
                "UNREADABLE Verdict build_manifest dump_manifest file_verdict",
    "metadata": "as_float",
    "retention": "RetentionPolicy",  # the report says why each checkpoint is kept
    "fingerprint": "run_fingerprint",
    "incremental": "shared_bytes stored_once",  # checkpoint.incremental: own / shared bytes of a checkpoint
    "durable": "write_atomic fsync_file copy_regular fsync_dir remove_tree replace_folder start_writeback "
               "write_durable write_json",
    "formats.safe_load": "load_pt",
    "formats.dcp_folder": "read_dcp_folder",
    # what the exports read and write besides the names above: a model folder's bytes
    "checksum": "default_algorithm hash_range hasher",
    "outofroom": "export_error",  # a full disk during an export, in one line
    "formats.registry": "exported_format detect_model_format",  # the format of a model folder the export reads
    "formats.pieces": "Piece ShardSource SourceTensor",  # a format's tensors as pieces of its files
    "formats.family": "DiskTensor auto_model_class c_strides disk_layout in_memory_dtypes",
    "formats.safetensors_io": "ST_TO_TORCH check_header encode_header header_length is_plain_float layout_order "
                              "parse_header pread_full pread_into pwrite_all read_header st_dtype_name "
                              "tensor_entries",
    "fastio.common": "ST_CODES",
    "fastio.readers": "ParallelHFReader read_safetensors",  # an archive's weights read in place
})

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_members(__name__, _EXPORTS, globals())
