"""Loading never runs code from a checkpoint, and load failures become one-line ``CheckpointError`` messages.

The only module that unpickles (tests/unit/test_structure.py); its rules: docs/integrity.md (safe loading).
``check_fits`` compares a checkpoint's keys and shapes with the state to load, and ``load_failure`` /
``save_failure`` turn DCP's multi-rank tracebacks into one line naming the folder."""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from automodel_ckpt.ondisk import bounded, layout, paths
from automodel_ckpt.errors import CheckpointError, first_line

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# No constructor here allocates from a count in the pickle (``bytes(2**31)``, ``bytearray(n)``): protocol 2 and
# later pickles store bytes, strings, lists, tuples, dicts and sets with opcodes of their own, whose size is the
# pickle's. What remains copies its arguments, so every call is charged to a budget (``_Budget``).
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [("builtins", n) for n in ("int", "float", "complex", "bool", "slice")]
    + [("collections", "OrderedDict")]
    + [("pathlib", n) for n in ("PosixPath", "PurePosixPath", "PureWindowsPath", "Path")]
    + [("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
)
_BUDGET_PER_BYTE = 4  # values the calls of a pickle may copy, per byte of the pickle (DCP's own use about 1)
_BUDGET_FLOOR = 1 << 20


_TORCH_VALUE_TYPES = (torch.dtype, torch.memory_format, torch.layout)


class _Budget:
    """The values one pickle's constructor calls have copied, refused past a limit (one memoized list, again and
    again, cannot make it copy gigabytes)."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def charge(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        values = [*args, *(kwargs or {}).values()]
        self.left -= 1 + sum(len(v) if isinstance(v, (str, bytes, tuple, list, dict, set, frozenset)) else 0
                             for v in values)
        if self.left < 0:
            raise pickle.UnpicklingError("its constructor calls copy more values than its size allows")

    def guard(self, real: type) -> type:
        """A stand-in for ``real`` (a class or a function) that charges each call (a class's ``__new__`` too) and
        returns what ``real`` does."""
        budget = self

        class Charged(type):
            def __call__(cls, *args: Any, **kwargs: Any) -> Any:
                budget.charge(args, kwargs)
                return real(*args, **kwargs)

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            budget.charge(args, kwargs)
            return real.__new__(real, *args, **kwargs)

        return Charged(real.__name__, (), {"__new__": new})


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler resolving only the globals DCP metadata needs (else ``UnpicklingError``), within ``budget``."""

    def __init__(self, file: Any, budget: int = _BUDGET_FLOOR) -> None:
        super().__init__(file)
        self._budget = _Budget(budget)

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        found = None
        if (module, name) in _ALLOWED:
            found = super().find_class(module, name)
        elif module == _DCP_METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as dcp_metadata

            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == _DCP_METADATA_MODULE:
                found = obj
        if found is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")
        return self._budget.guard(found)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not allowed in checkpoint metadata")


@functools.lru_cache(maxsize=1)
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the storage names torch.save pickles for each dtype."""
    try:
        return torch.storage._storage_type_to_dtype_map()
    except AttributeError:
        return {}


class StorageRef:
    """The storage a tensor record's pickle names: its key in the record, dtype and number of elements."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorRecordUnpickler(pickle.Unpickler):
    """Reads a torch.save'd tensor's pickle into (storage, storage offset, size, stride) without building it: a
    plain tensor's globals become inert stand-ins, anything else raises ``UnpicklingError`` (then ``torch.load``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            dtype = _storage_dtypes().get(name)
            if dtype is not None:
                return dtype
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("unexpected storage type")
        return StorageRef(str(key), dtype, int(numel))


class _OwnUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, aside: tuple[str, str], resolve: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._aside, self._resolve = aside, resolve

    def find_class(self, module: str, name: str) -> Any:
        return self._resolve if (module, name) == self._aside else super().find_class(module, name)


def unpickle_own(data: bytes, aside: tuple[str, str], resolve: Any) -> Any:
    """A value this process pickled itself (never read from a file); its global ``aside`` is ``resolve``."""
    return _OwnUnpickler(data, aside, resolve).load()


def load_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file safely; ``CheckpointError`` naming the file on any problem."""
    path = Path(path)
    try:
        with os.fdopen(paths.open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            bounded.check_size(size, f"'{path}'", "DCP metadata", bounded.DCP_METADATA)
            metadata = RestrictedUnpickler(f, max(_BUDGET_FLOOR, _BUDGET_PER_BYTE * size)).load()
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' is missing (the index of the DCP files beside it)") from None
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refusing to load '{path}': {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled pickles raise many types
        raise CheckpointError(f"'{path}' is unreadable: {type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"'{path}' is not DCP metadata (holds a {type(metadata).__name__})")
    check_entries(metadata, path)
    _check_storage_files(metadata, path)
    return metadata


def check_entries(metadata: Metadata, path: Path) -> None:
    """Every entry is tensor or bytes metadata under a string key; a tensor's size is at most
    ``bounded.MAX_SHAPE_DIMS`` non-negative integers, its dtype a torch dtype, and each chunk a box of that many
    dimensions inside it; every storage entry a byte range of a file. Linear in the number of chunks."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not (storage is None or isinstance(storage, dict)):
        raise CheckpointError(f"'{path}' is not DCP metadata (no table of entries)")
    for key, md in entries.items():
        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"'{path}': entry {str(key)[:200]!r} {why}")

        if not isinstance(key, str):
            raise bad("has a key that is not a string")
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(f"is a {type(md).__name__}, not tensor or bytes metadata")
        shape = getattr(md, "size", None)
        if not _is_box(shape, None):
            raise bad(f"has a size that is not up to {bounded.MAX_SHAPE_DIMS} non-negative integers")
        if not isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype):
            raise bad("has no torch dtype")
        chunks = getattr(md, "chunks", None)
        if not isinstance(chunks, list):
            raise bad("has no list of chunks")
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (_is_box(offsets, len(shape)) and _is_box(sizes, len(shape))
                    and all(o + n <= d for o, n, d in zip(offsets, sizes, shape))):
                raise bad(f"has a chunk outside its size {list(shape)}")
    for index, info in (storage or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str) \
                or not all(bounded.is_count(getattr(info, k, None)) for k in ("offset", "length")):
            raise CheckpointError(f"'{path}': a storage entry is not a byte range of a file")


def _is_box(value: object, dims: int | None) -> bool:
    return isinstance(value, (tuple, list)) and len(value) <= bounded.MAX_SHAPE_DIMS \
        and (dims is None or len(value) == dims) and all(bounded.is_count(v) for v in value)


def _check_storage_files(metadata: Metadata, path: Path) -> None:
    """Every data file the metadata names is a plain relative path inside its folder and, if it exists, regular."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return
    seen: set[object] = set()
    resolved: dict[str, str] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str) and rel in seen:
            continue
        seen.add(rel)
        file = paths.path_inside(path.parent, rel, f"'{path}'", resolved)
        try:
            why = paths.regular_file_problem(file)
        except FileNotFoundError:
            continue  # reported as missing where it is read (or by the manifest check before)
        except OSError as exc:
            why = first_line(exc)
        if why:
            raise CheckpointError(f"'{file}' (named by '{path}') is {why}; refusing to read it")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by ``RestrictedUnpickler`` (and cached per reader)."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            rank = kwargs.get("rank")
            get_path = getattr(self, "_get_metadata_path", None)
            path = get_path(rank) if get_path is not None else Path(self.path) / layout.DCP_METADATA
            self._cached = load_dcp_metadata(Path(path))
        metadata = self._cached
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class CachingHFReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` (safetensors headers: JSON, no pickle) that reads its metadata once."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            try:
                self._cached = super().read_metadata(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"cannot read the safetensors shards in '{self.path}': {type(exc).__name__}: "
                                      f"{first_line(exc)}") from None
        return self._cached


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries with ``weights_only=True``."""

    def __init__(self, source: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = Path(source)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from automodel_ckpt.distributed.dcp_private import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"refusing to load entry '{fqn}' of '{self.source}': {first_line(exc)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    try:
        from automodel_ckpt.distributed.dcp_private import flatten_state_dict

        flat, _ = flatten_state_dict(state)
        return flat
    except Exception:  # noqa: BLE001 - private helper; a flat dict is good enough for the report
        return dict(state)


def _differences(state: dict[str, Any], metadata: Metadata, held: set[str] | None = None) -> list[str]:
    """Differences between the state to load and a checkpoint's metadata, by key; ``held``: the keys some rank holds."""
    want = _flat(state)
    have = metadata.state_dict_metadata
    held = set(want) if held is None else held | set(want)
    out = []
    for key in sorted(set(want) | set(have)):
        if key not in have:
            out.append(f"{key}: in the model, not in the checkpoint")
        elif key not in want:
            if key not in held:
                out.append(f"{key}: in the checkpoint, not in the model")
        elif (isinstance(want[key], torch.Tensor) and not isinstance(have[key], BytesStorageMetadata)
              and tuple(have[key].size) != tuple(want[key].size())):
            out.append(f"{key}: shape {list(have[key].size)} in the checkpoint, {list(want[key].size())} in the model")
    return out


def check_fits(state: dict[str, Any], metadata: Metadata, path: Path, limit: int = 5,
               held: set[str] | None = None) -> None:
    """Raise ``CheckpointError`` listing the first differing keys if ``path`` holds state of another model."""
    diffs = _differences(state, metadata, held)
    if diffs:
        raise CheckpointError(_misfit(path, diffs, limit))


def _misfit(path: Path, diffs: list[str], limit: int = 5) -> str:
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (f"checkpoint '{path}' does not fit this model ({len(diffs)} keys differ; was it saved from another "
            f"model or config?): " + "; ".join(diffs[:limit]) + more)


def root_cause(exc: BaseException) -> BaseException:
    """The first rank's underlying exception of a DCP ``CheckpointException`` (else ``exc`` itself)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank = sorted(exc.failures)[0]
        inner = exc.failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return root_cause(inner) if isinstance(inner, BaseException) else exc
    return exc


def load_failure(exc: BaseException, path: Path, state: dict[str, Any] | None = None,
                 metadata: Metadata | None = None) -> CheckpointError:
    """A one-line error for a failed DCP load of ``path``."""
    cause = root_cause(exc)
    if isinstance(cause, CheckpointError):
        return CheckpointError(str(cause))
    if state is not None and metadata is not None:
        diffs = _differences(state, metadata)
        if diffs:
            return CheckpointError(_misfit(path, diffs))
    return CheckpointError(f"cannot load '{path}': {type(cause).__name__}: {first_line(cause)}")


def save_failure(exc: BaseException, path: Path) -> CheckpointError:
    """A one-line error for a failed DCP save into ``path`` (disk full, read-only, ...)."""
    cause = root_cause(exc)
    if isinstance(cause, CheckpointError):
        return CheckpointError(str(cause))
    return CheckpointError(f"cannot write '{path}': {type(cause).__name__}: {first_line(cause)}")


def load_pt(file: Path) -> Any:
    """A small regular ``.pt`` state file, ``weights_only``; a one-line ``CheckpointError`` if unreadable."""
    try:
        with open(paths.open_regular(Path(file)), "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read '{file}': {first_line(exc)}") from None
