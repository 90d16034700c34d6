"""The pickle of a DCP ``Metadata`` with its chunk lists and storage table written as numpy records.

The large parts are pickle holes filled with the opcodes ``pickle`` would write: the same objects load."""

from __future__ import annotations

import io
import itertools
import pickle
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from automodel_ckpt.distributed.dcp_private import StorageInfo
from automodel_ckpt.ondisk.fastio.records import NOTE

#: A list or table shorter than this is left to ``pickle``.
MIN_ITEMS = 256
_KEYS = {ChunkStorageMetadata: ("offsets", "sizes"), MetadataIndex: ("fqn", "index", "offset"),
         StorageInfo: ("relative_path", "offset", "length")}
_SAMPLES = (ChunkStorageMetadata(torch.Size([0]), torch.Size([1])), MetadataIndex("a", torch.Size([0]), 0),
            StorageInfo("a", 0, 1))
_INFO = ("relative_path", "offset", "length")  # a ``_StorageInfo``'s state: these, ``records.NOTE`` where set
_INFO_STATES = {_INFO, (*_INFO, "transform_descriptors"), (*_INFO, NOTE), (*_INFO, "transform_descriptors", NOTE)}
_I32 = (-(1 << 31), (1 << 31) - 1)
_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)
_TUPLE = {0: pickle.EMPTY_TUPLE, 1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


def _shapes_known() -> bool:
    """Whether this torch pickles the three classes as this module writes them (a state dict of those keys)."""
    import copyreg

    for sample in _SAMPLES:
        reduced = sample.__reduce_ex__(3)
        if reduced[0] is not copyreg.__newobj__ or reduced[1] != (type(sample),) or \
                not isinstance(reduced[2], dict) or tuple(reduced[2]) != _KEYS[type(sample)]:
            return False
    return True


class _Hole:
    def __init__(self, value: Any) -> None:
        self.value = value


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return f"\0hole {id(obj)}" if type(obj) is _Hole else None


class _Memo:
    """Memo slots from ``base`` on for the shared objects, and the opcodes that fill them (the prologue)."""

    def __init__(self, base: int) -> None:
        self.slots: dict[Any, int] = {}
        self.base, self.prologue = base, io.BytesIO()

    def slot(self, obj: Any) -> int:
        self.get(obj)
        return self.slots[(type(obj), obj)]

    def get(self, obj: Any) -> bytes:
        key = (type(obj), obj)
        if key not in self.slots:
            self.slots[key] = slot = self.base + len(self.slots)
            if isinstance(obj, type):
                self.prologue.write(pickle.GLOBAL + f"{obj.__module__}\n{obj.__qualname__}\n".encode())
            elif isinstance(obj, torch.dtype):  # as torch pickles it: ``torch.<name>``
                self.prologue.write(pickle.GLOBAL + f"torch\n{str(obj).removeprefix('torch.')}\n".encode())
            else:
                data = obj.encode("utf-8", "surrogatepass")
                self.prologue.write(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)
            self.prologue.write(pickle.LONG_BINPUT + struct.pack("<I", slot) + pickle.POP)
        return pickle.LONG_BINGET + struct.pack("<I", self.slots[key])


class _Records:
    """Fixed-width records, one per item: constant opcodes, each followed by a column of raw values or none."""

    def __init__(self, count: int) -> None:
        self.count, self.parts = count, []

    def const(self, data: bytes) -> None:
        self.parts.append((data, None))

    def ints(self, column: np.ndarray) -> None:
        small = column.size == 0 or (column.min() >= _I32[0] and column.max() <= _I32[1])
        self.parts.append((pickle.BININT, column.astype("<i4")) if small else (pickle.LONG1 + b"\x08",
                                                                                column.astype("<i8")))

    def tuple(self, rows: np.ndarray) -> None:
        """Each row of ``rows`` (``[count, d]``) as a tuple of integers."""
        many = rows.shape[1] not in _TUPLE
        self.const(pickle.MARK if many else b"")
        for j in range(rows.shape[1]):
            self.ints(rows[:, j])
        self.const(pickle.TUPLE if many else _TUPLE[rows.shape[1]])

    def size(self, memo: _Memo, dims: np.ndarray | None) -> None:
        """``torch.Size(row)`` of each row of ``dims`` (``[count, d]``); None: ``None``."""
        if dims is None:
            return self.const(pickle.NONE)
        self.const(memo.get(torch.Size))
        self.tuple(dims)
        self.const(pickle.TUPLE1 + pickle.REDUCE)

    def long(self, column: np.ndarray, width: int) -> tuple[bytes, np.ndarray]:
        """Non-negative integers as ``LONG1`` of ``width`` (>= 8) bytes: a record's width can be set by it."""
        return (pickle.LONG1 + bytes([width]), np.pad(column.astype("<i8").view(np.uint8).reshape(self.count, 8),
                                                       ((0, 0), (0, width - 8))))

    def width(self) -> int:
        return sum(len(op) + (0 if column is None else column.nbytes // max(self.count, 1))
                   for op, column in filter(None, self.parts))

    def array(self) -> np.ndarray:
        """``[count, width]`` bytes: each row one item's opcodes."""
        out = np.empty((self.count, self.width()), dtype=np.uint8)
        at = 0
        for op, column in self.parts:
            out[:, at:at + len(op)] = np.frombuffer(op, dtype=np.uint8)
            at += len(op)
            if column is None:
                continue
            raw = column.view(np.uint8).reshape(self.count, -1)
            out[:, at:at + raw.shape[1]] = raw
            at += raw.shape[1]
        return out


def _object(memo: _Memo, cls: type) -> bytes:
    return memo.get(cls) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK


def _sizes(values: list[Any], dims: int, kind: type = torch.Size) -> np.ndarray | None:
    if set(map(type, values)) != {kind} or set(map(len, values)) != {dims}:
        return None
    return np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64,
                       count=len(values) * dims).reshape(len(values), dims)


def _chunks(memo: _Memo, chunks: list[Any]) -> bytes | None:
    """The opcodes of a list of chunks, or None if one is not a plain ``ChunkStorageMetadata`` of equal rank."""
    if {type(c) for c in chunks} != {ChunkStorageMetadata}:
        return None
    dims = len(chunks[0].offsets)
    offsets, sizes = _sizes([c.offsets for c in chunks], dims), _sizes([c.sizes for c in chunks], dims)
    if offsets is None or sizes is None:
        return None
    rec = _Records(len(chunks))
    rec.const(_object(memo, ChunkStorageMetadata) + memo.get("offsets"))
    rec.size(memo, offsets)
    rec.const(memo.get("sizes"))
    rec.size(memo, sizes)
    rec.const(pickle.SETITEMS + pickle.BUILD)
    return pickle.EMPTY_LIST + pickle.MARK + rec.array().tobytes() + pickle.APPENDS


class StorageRows:
    """A storage table not yet made of objects: every rank's ``plan_results.encode`` tuples, in rank order."""

    def __init__(self, ranks: list[list[tuple]]) -> None:
        self.ranks = ranks

    def __len__(self) -> int:
        return sum(map(len, self.ranks))

    def table(self, memo: _Memo) -> Table | None:
        """The ``Table`` these results make, or None (as ``_storage_rows``)."""
        return _storage_rows(memo, self)


def _storage(memo: _Memo, table: Any) -> bytes | None:
    """The opcodes of a storage table (a dict, or anything whose ``table(memo)`` gives its ``Table``), or None."""
    if _unmade(table):
        made = table.table(memo)
        return None if made is None else emit(memo, made)
    keys, infos = list(table), list(table.values())
    notes = [getattr(v, NOTE, None) for v in infos]
    if {type(k) for k in keys} != {MetadataIndex} or {type(v) for v in infos} != {StorageInfo} or \
            not {tuple(v.__dict__) for v in infos} <= _INFO_STATES or \
            any(getattr(v, "transform_descriptors", None) is not None for v in infos):
        return None
    return _storage_columns(memo, [k.fqn for k in keys], [k.offset for k in keys], [k.index for k in keys],
                            [v.relative_path for v in infos], [v.offset for v in infos], [v.length for v in infos],
                            notes, torch.Size)


def _unmade(table: Any) -> bool:
    """Whether ``table`` is a storage table not made of objects (it gives its ``Table``)."""
    return not isinstance(table, dict) and callable(getattr(table, "table", None))


def _storage_rows(memo: _Memo, table: StorageRows) -> Table | None:
    """The ``Table`` that ``table``'s write results make, or None where two results share a key."""
    rows = list(itertools.chain.from_iterable(table.ranks))
    if not rows or set(map(len, rows)) != {8}:
        return None
    fqns, offsets, indexes, _, paths, at, lengths, notes = zip(*rows)
    if len(set(zip(fqns, offsets))) != len(rows):  # MetadataIndex compares its fqn and offset only
        return None
    return _table(memo, fqns, offsets, indexes, paths, at, lengths, notes, tuple)


@dataclass
class Table:
    """A storage table as columns, a row per entry: ``fqn`` and ``path`` as memo slots, the key's ``index``, the
    value's ``at``, ``length`` and ``note_at``, and per ``Shape`` its rows' offsets and note shapes."""

    fqn_slots: np.ndarray
    path_slots: np.ndarray
    index: np.ndarray
    info_offset: np.ndarray
    length: np.ndarray
    note_at: np.ndarray
    shapes: list[tuple["Shape", np.ndarray, np.ndarray | None, np.ndarray | None]]


@dataclass(frozen=True)
class Shape:
    """A storage record's shape: its key's offset rank (-1: None), no index, its note's rank (-1: none), dtype."""

    dims: int
    no_index: bool
    note_dims: int
    note_dtype: Any


def _storage_columns(memo: _Memo, fqns: Any, offsets: Any, indexes: Any, paths: Any, at: Any, lengths: Any,
                     notes: Any, offset_type: type) -> bytes | None:
    """The storage table's opcodes from its columns, each in the table's order."""
    table = _table(memo, fqns, offsets, indexes, paths, at, lengths, notes, offset_type)
    return None if table is None else emit(memo, table)


def _table(memo: _Memo, fqns: Any, offsets: Any, indexes: Any, paths: Any, at: Any, lengths: Any,
           notes: Any, offset_type: type) -> Table | None:
    # every pass over the columns in C (``map``): millions of rows at thousands of ranks
    offset_types, index_types, note_types = set(map(type, offsets)), set(map(type, indexes)), set(map(type, notes))
    if set(map(type, fqns)) | set(map(type, paths)) != {str} or set(map(type, at)) | set(map(type, lengths)) != {int} \
            or not note_types <= {tuple, type(None)} or not offset_types <= {offset_type, type(None)} \
            or not index_types <= {int, type(None)}:
        return None
    noted = notes if type(None) not in note_types else [n for n in notes if n is not None]
    shapes = list(map(_SECOND, noted))
    if noted and (set(map(len, noted)) != {3} or set(map(type, map(_FIRST, noted))) != {int} or
                  set(map(type, shapes)) != {tuple} or set(map(type, map(_THIRD, noted))) != {torch.dtype} or
                  not set(map(type, itertools.chain.from_iterable(shapes))) <= {int}):
        return None
    count = len(fqns)
    # groups of one record shape: the offset's rank (-1: None), whether there is an index, the note's shape
    dtypes: dict[Any, int] = {}
    if type(None) in offset_types:
        ranks = np.array([-1 if o is None else len(o) for o in offsets])
    else:
        ranks = np.fromiter(map(len, offsets), dtype=np.int64, count=count)
    no_index = np.array([i is None for i in indexes]) if type(None) in index_types else np.zeros(count, dtype=bool)
    if type(None) in note_types or not noted:
        note_ranks = np.array([-1 if n is None else len(n[1]) for n in notes])
        note_dtypes = np.array([-1 if n is None else dtypes.setdefault(n[2], len(dtypes)) for n in notes])
    else:
        note_ranks = np.fromiter(map(len, shapes), dtype=np.int64, count=count)
        dtypes = {d: i for i, d in enumerate(dict.fromkeys(map(_THIRD, notes)))}  # in first appearance, as above
        note_dtypes = np.fromiter(map(dtypes.__getitem__, map(_THIRD, notes)), dtype=np.int64, count=count)
    columns = np.stack([ranks, no_index, note_ranks, note_dtypes]).astype(np.int64) + 1
    scale = columns.max(axis=1) + 1
    kinds, code_of = np.unique(np.ravel_multi_index(tuple(columns), tuple(scale)), return_inverse=True)
    kinds, dtype_of = np.stack(np.unravel_index(kinds, tuple(scale)), axis=1) - 1, list(dtypes)
    # the columns, each read once: strings by reference (their memo slots), integers
    slot = {text: memo.slot(text) for text in {*fqns, *paths}}
    grouped = []
    for code, (dims, no_idx, note_dims, note_dtype) in enumerate(kinds.tolist()):
        rows = np.flatnonzero(code_of.reshape(-1) == code)
        every = len(kinds) == 1  # one record shape: every row, in order
        listed = range(count) if every else rows.tolist()
        starts = None if dims < 0 else _sizes(offsets if every else [offsets[i] for i in listed], dims, offset_type)
        if dims >= 0 and starts is None:
            return None
        note_shapes = None
        if note_dims >= 0:
            picked = map(_SECOND, notes) if every else (notes[i][1] for i in listed)
            note_shapes = np.fromiter(itertools.chain.from_iterable(picked), dtype=np.int64,
                                      count=len(listed) * note_dims).reshape(len(listed), note_dims)
        grouped.append((Shape(dims, bool(no_idx), note_dims, None if note_dims < 0 else dtype_of[note_dtype]),
                        rows, starts, note_shapes))
    return Table(
        np.fromiter(map(slot.__getitem__, fqns), dtype="<u4", count=count),
        np.fromiter(map(slot.__getitem__, paths), dtype="<u4", count=count),
        np.array([0 if i is None else i for i in indexes], dtype=np.int64) if type(None) in index_types else
        np.fromiter(indexes, dtype=np.int64, count=count),
        np.fromiter(at, dtype=np.int64, count=count), np.fromiter(lengths, dtype=np.int64, count=count),
        np.array([0 if n is None else n[0] for n in notes], dtype=np.int64) if type(None) in note_types else
        np.fromiter(map(_FIRST, notes), dtype=np.int64, count=count), grouped)


def emit(memo: _Memo, table: Table) -> bytes | None:
    """The opcodes of a storage table given as ``Table``, or None where its records cannot be made equally wide."""
    built = []
    for shape, rows, starts, note_shapes in table.shapes:
        rec = _Records(len(rows))
        rec.const(_object(memo, MetadataIndex) + memo.get("fqn") + pickle.LONG_BINGET)
        rec.parts.append((b"", table.fqn_slots[rows]))
        rec.const(memo.get("index") + (pickle.NONE if shape.no_index else b""))
        if not shape.no_index:
            rec.ints(table.index[rows])
        rec.const(memo.get("offset"))
        rec.size(memo, starts)
        rec.const(pickle.SETITEMS + pickle.BUILD + _object(memo, StorageInfo) + memo.get("relative_path") +
                  pickle.LONG_BINGET)
        rec.parts.append((b"", table.path_slots[rows]))
        rec.const(memo.get("offset"))
        rec.parts.append(None)  # the offset, as wide as makes every record of the table equally wide (below)
        rec.const(memo.get("length"))
        rec.ints(table.length[rows])
        if shape.note_dims >= 0:  # (where the tensor's bytes start, its shape, its dtype)
            rec.const(memo.get(NOTE))
            rec.ints(table.note_at[rows])
            rec.tuple(note_shapes)
            rec.const(memo.get(shape.note_dtype) + pickle.TUPLE3)
        rec.const(pickle.SETITEMS + pickle.BUILD)
        built.append((rows, rec, table.info_offset[rows]))
    # every record as wide as the widest (its offset's LONG1 takes the difference): the table's order by row
    widest = max(rec.width() for _, rec, _ in built) + 10
    if widest - min(rec.width() for _, rec, _ in built) - 2 > 255:
        return None
    out = np.empty((len(table.fqn_slots), widest), dtype=np.uint8)
    for rows, rec, offset in built:
        rec.parts[rec.parts.index(None)] = rec.long(offset, widest - rec.width() - 2)
        out[rows] = rec.array()
    return b"".join((pickle.EMPTY_DICT + pickle.MARK, out.data, pickle.SETITEMS))  # one copy of the records


def _plain(metadata: Any, protocol: int) -> bytes | None:
    """``pickle``'s own pickle of ``metadata``; None where its storage table is not made of objects."""
    return None if _unmade(getattr(metadata, "storage_data", None)) else pickle.dumps(metadata, protocol=protocol)


def dumps(metadata: Any, protocol: int = 3) -> bytes | None:
    """``pickle.dumps(metadata, protocol)`` (2 or 3), large parts as records; None: make the table's objects first."""
    holes: list[tuple[Any, str, _Hole]] = []
    entries = getattr(metadata, "state_dict_metadata", None) or {}
    if protocol in (2, 3) and _shapes_known():
        holes = [(md, "chunks", _Hole(md.chunks)) for md in entries.values()
                 if type(md) is TensorStorageMetadata and len(md.chunks) >= MIN_ITEMS]
        storage = getattr(metadata, "storage_data", None)
        if (isinstance(storage, dict) or _unmade(storage)) and len(storage) >= MIN_ITEMS:
            holes.append((metadata, "storage_data", _Hole(metadata.storage_data)))
    if not holes:
        return _plain(metadata, protocol)
    out = io.BytesIO()
    pickler = _Pickler(out, protocol=protocol)
    for owner, name, hole in holes:
        setattr(owner, name, hole)
    try:
        pickler.dump(metadata)
    finally:
        for owner, name, hole in holes:
            setattr(owner, name, hole.value)
    data = out.getvalue()
    memo = _Memo(len(pickler.memo.copy()) + 1)
    filled = []
    for _, name, hole in holes:
        fill = _storage(memo, hole.value) if name == "storage_data" else _chunks(memo, hole.value)
        if fill is None:
            return _plain(metadata, protocol)
        pid = f"\0hole {id(hole)}".encode()
        at = data.index(pickle.BINUNICODE + struct.pack("<I", len(pid)) + pid)
        end = at + 5 + len(pid)
        end += {pickle.BINPUT: 2, pickle.LONG_BINPUT: 5}.get(data[end:end + 1], 0)  # the id's memo slot, unused
        if data[end:end + 1] != pickle.BINPERSID:
            return _plain(metadata, protocol)
        filled.append((at, end + 1, fill))
    parts, last = [data[:2], memo.prologue.getvalue()], 2
    for at, end, fill in sorted(filled, key=lambda f: f[0]):
        parts += [data[last:at], fill]
        last = end
    parts.append(data[last:])
    return b"".join(parts)
