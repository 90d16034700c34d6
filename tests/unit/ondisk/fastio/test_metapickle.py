"""A ``.metadata``'s pickle with its chunk lists and storage table built as records loads as the same objects as
``pickle.dumps``'s, in the same order, through ``pickle``, the restricted unpickler and DCP's reader."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from automodel_ckpt.ondisk.fastio import metapickle
from automodel_ckpt.ondisk.fastio.records import NOTE
from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata


def _metadata(chunks: int, seed: int = 0) -> Metadata:
    """Tensors of 0 to 5 dimensions cut in ``chunks``; storage entries with and without an index, an offset, the
    writer's note (1 to 3 dimensions, two dtypes), and offsets past 2**31; a bytes entry."""
    rng = random.Random(seed)
    entries, storage = {}, {}
    for t, dims in enumerate([2, 1, 0, 5, 2, 3]):
        fqn = f"state.layers.{t}.exp_avg"
        count = chunks if dims else 1
        boxes = []
        for i in range(count):
            offsets = torch.Size([i * 7] + [rng.randrange(3) for _ in range(dims - 1)]) if dims else torch.Size([])
            sizes = torch.Size([7] + [rng.randrange(1, 5) for _ in range(dims - 1)]) if dims else torch.Size([])
            boxes.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            info = _StorageInfo(f"__{i % 5}_0.distcp", rng.randrange(1 << 34), rng.randrange(1 << 20))
            if i % 3:
                setattr(info, NOTE, (rng.randrange(900), tuple(rng.randrange(9) for _ in range(i % 3 + dims % 2)),
                                     (torch.float32, torch.bfloat16)[i % 2]))
            storage[MetadataIndex(fqn, offsets, i if t == 4 else None)] = info
        size = torch.Size([count * 7] + [9] * (dims - 1)) if dims else torch.Size([])
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), size, boxes)
    entries["param_groups"] = BytesStorageMetadata()
    storage[MetadataIndex("param_groups")] = _StorageInfo("__0_0.distcp", 5, 6)
    return Metadata(state_dict_metadata=entries, storage_data=storage, planner_data={"a": ("b",)}, version="1.0.0")


def _same(ours: Metadata, theirs: Metadata) -> None:
    assert ours == theirs
    assert list(ours.storage_data) == list(theirs.storage_data)
    def state(info):  # what pickling keeps of a storage entry (``_StorageInfo.__getstate__``: no None fields)
        return [(k, v) for k, v in vars(info).items() if v is not None]  # in order

    assert [state(v) for v in ours.storage_data.values()] == [state(v) for v in theirs.storage_data.values()]
    for key, md in theirs.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            assert [(type(c.offsets), type(c.sizes)) for c in ours.state_dict_metadata[key].chunks] == \
                [(torch.Size, torch.Size)] * len(md.chunks)


@pytest.mark.parametrize("chunks", [metapickle.MIN_ITEMS, 700])
def test_records_load_as_the_objects_pickle_writes(chunks):
    metadata = _metadata(chunks)
    data = metapickle.dumps(metadata)
    assert data != pickle.dumps(metadata, protocol=3)  # the records were used
    _same(pickle.loads(data), pickle.loads(pickle.dumps(metadata, protocol=3)))  # noqa: S301 - this test's own
    _same(pickle.loads(data), metadata)  # noqa: S301
    loaded = pickle.loads(data)  # noqa: S301 - entries as a reader holds them (no None fields): records again
    assert metapickle.dumps(loaded) != pickle.dumps(loaded, protocol=3)
    _same(pickle.loads(metapickle.dumps(loaded)), metadata)  # noqa: S301


def test_small_or_unusual_metadata_is_pickled_by_pickle():
    small = _metadata(3)
    assert metapickle.dumps(small) == pickle.dumps(small, protocol=3)
    odd = _metadata(400)
    next(iter(odd.storage_data.values())).extra = "kept"  # a state this module does not write
    assert metapickle.dumps(odd) == pickle.dumps(odd, protocol=3)
    box = odd.state_dict_metadata["state.layers.0.exp_avg"].chunks
    box[5] = ChunkStorageMetadata(offsets=(35, 0), sizes=torch.Size([7, 1]))  # a plain tuple, not a Size
    assert pickle.loads(metapickle.dumps(odd)).state_dict_metadata["state.layers.0.exp_avg"].chunks[5].offsets \
        == (35, 0)  # noqa: S301


def test_the_restricted_unpickler_and_dcps_reader_read_it(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    metadata = _metadata(300)
    (tmp_path / ".metadata").write_bytes(metapickle.dumps(metadata))
    _same(load_dcp_metadata(tmp_path / ".metadata"), metadata)
    theirs = FileSystemReader(tmp_path).read_metadata()
    theirs.storage_meta = None  # the reader's load id
    _same(theirs, metadata)


def _rows(metadata: Metadata) -> list[list[tuple]]:
    """The metadata's storage table as three ranks' write results, as ``plan_results.encode`` sends them."""
    rows = [(k.fqn, None if k.offset is None else tuple(k.offset), k.index, 1, v.relative_path, v.offset, v.length,
             getattr(v, NOTE, None)) for k, v in metadata.storage_data.items()]
    third = len(rows) // 3
    return [rows[:third], rows[third:2 * third], rows[2 * third:]]


def test_a_storage_table_written_from_the_ranks_tuples_is_the_same_pickle():
    """The storage table straight from every rank's write-result tuples (no ``MetadataIndex`` or ``_StorageInfo``
    made) is byte for byte the pickle of the table made of objects; two results of one key, which a table keeps
    once, are left to the objects (the file the same)."""
    from automodel_ckpt.ondisk.fastio import metafile
    from automodel_ckpt.ondisk.saveplan.plan_results import decode

    metadata = _metadata(700)
    objects = metapickle.dumps(metadata)
    ranks = _rows(metadata)
    table, metadata.storage_data = metadata.storage_data, metapickle.StorageRows(ranks)
    assert metapickle.dumps(metadata) == objects
    metadata.storage_data = table

    def results():
        return [decode(r) for r in ranks]

    data, _ = metafile.body(metadata, results, None, None, lambda: metapickle.StorageRows(ranks))
    assert data == objects[:-1]  # the body: without its STOP
    twice = [ranks[0], ranks[1], ranks[2] + ranks[0][:1]]  # a key twice: the table keeps the first, last value
    metadata.storage_data = metapickle.StorageRows(twice)
    assert metapickle.dumps(metadata) is None
    metadata.storage_data = table
    data, _ = metafile.body(metadata, lambda: [decode(r) for r in twice], None, None,
                            lambda: metapickle.StorageRows(twice))
    assert data == objects[:-1]


def test_a_table_whose_every_entry_has_an_index_an_offset_and_a_note_loads_the_same():
    """The table a sharded optimizer writes (every entry an index, an offset and the writer's note: the passes
    that skip the missing ones): its records, from objects and from the ranks' tuples, load as pickle's objects."""
    metadata = _metadata(700, seed=5)
    rng = random.Random(5)
    table = {}
    for i, (key, info) in enumerate(metadata.storage_data.items()):
        if key.offset is None:
            continue
        if getattr(info, NOTE, None) is None:
            setattr(info, NOTE, (rng.randrange(900), (3, 4), (torch.float32, torch.bfloat16, torch.int64)[i % 3]))
        table[MetadataIndex(key.fqn, key.offset, i)] = info
    metadata.storage_data = table
    data = metapickle.dumps(metadata)
    assert data != pickle.dumps(metadata, protocol=3)  # records, not pickle's own
    _same(pickle.loads(data), pickle.loads(pickle.dumps(metadata)))
    metadata.storage_data = metapickle.StorageRows(_rows(metadata))
    assert metapickle.dumps(metadata) == data
    # one record shape throughout (one tensor's chunks, notes of one rank and dtype): the columns taken whole
    first = next(iter(table)).fqn
    metadata.storage_data = {k: v for k, v in table.items() if k.fqn == first}
    for info in metadata.storage_data.values():
        setattr(info, NOTE, (getattr(info, NOTE)[0], (3, 4), torch.float32))
    assert len(metadata.storage_data) >= metapickle.MIN_ITEMS
    data = metapickle.dumps(metadata)
    _same(pickle.loads(data), pickle.loads(pickle.dumps(metadata)))
    metadata.storage_data = metapickle.StorageRows(_rows(metadata))
    assert metapickle.dumps(metadata) == data


def _columns(ranks: list[list[tuple]]):
    """Each rank's tuples as ``result_columns.ResultColumns``, their item lists read back as the coordinator
    reads them (the ranks of one list share it)."""
    from automodel_ckpt.ondisk.saveplan.result_columns import split

    shared: dict = {}
    out = []
    for rows in ranks:
        columns = split(rows)
        assert columns is not None
        out.append(dataclasses.replace(columns, items=shared.setdefault(pickle.dumps(columns.items), columns.items)))
    return out


@pytest.mark.parametrize("seed,small", [(0, False), (5, False), (0, True)])
def test_a_storage_table_written_from_the_ranks_columns_loads_as_the_objects(seed, small):
    """Every rank's write results as columns (items, numbers, files): the table written from them in numpy loads
    as the table made of objects, in the same order, through pickle and the restricted unpickler; each rank's
    tuples come back from its columns. ``small``: the first rank's numbers fit int32 (sent 4 bytes each), the
    others' do not."""
    from automodel_ckpt.ondisk.saveplan.result_columns import StorageColumns, joined

    metadata = _metadata(700, seed=seed)
    if small:
        for info in list(metadata.storage_data.values())[:len(metadata.storage_data) // 3]:
            info.offset %= 1 << 20
    ranks = _rows(metadata)
    columns = _columns(ranks)
    assert [c.width for c in columns] == ([4, 8, 8] if small else [8, 8, 8])
    assert [joined(c) for c in columns] == ranks
    table, metadata.storage_data = metadata.storage_data, StorageColumns(columns)
    data = metapickle.dumps(metadata)
    assert data is not None
    metadata.storage_data = table
    _same(pickle.loads(data), metadata)  # noqa: S301 - this test's own
    _same(metapickle_loaded(data), metadata)


def metapickle_loaded(data: bytes):
    import io

    from automodel_ckpt.ondisk.formats.safe_load import RestrictedUnpickler

    return RestrictedUnpickler(io.BytesIO(data)).load()


def test_columns_of_a_rank_that_writes_one_key_twice_are_left_to_the_objects():
    from automodel_ckpt.ondisk.fastio import metafile
    from automodel_ckpt.ondisk.saveplan.plan_results import decode
    from automodel_ckpt.ondisk.saveplan.result_columns import StorageColumns

    metadata = _metadata(700)
    objects = metapickle.dumps(metadata)
    ranks = _rows(metadata)
    twice = [ranks[0], ranks[1], ranks[2] + ranks[2][:1]]
    table, metadata.storage_data = metadata.storage_data, StorageColumns(_columns(twice))
    assert metapickle.dumps(metadata) is None
    metadata.storage_data = table
    data, _ = metafile.body(metadata, lambda: [decode(r) for r in twice], None, None,
                            lambda: StorageColumns(_columns(twice)))
    assert data == objects[:-1]
