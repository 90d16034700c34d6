"""The parallel model/optimizer file writers and readers (ondisk/fastio): same files as torch's, exact
round trips, torch's readers read ours and ours read torch's, partial reads, checksums noted while writing.

In-process, through a one-rank process group.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)

from automodel_ckpt.ondisk import manifest, durable
from automodel_ckpt.ondisk import fastio
from automodel_ckpt.ondisk.formats import registry, sharded
from automodel_ckpt.ondisk.fastio import common, filewrite, readers, records
from automodel_ckpt.distributed.env import init_distributed

FORMATS = ("safetensors", "torch_save")


@pytest.fixture(scope="module", autouse=True)
def env():
    return init_distributed()


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Small writes and reads, so that even a small model is split across threads and chunks."""
    monkeypatch.setattr(common, "CHUNK", 4096)
    monkeypatch.setattr(common, "SMALL", 1024)


def model_and_optimizer(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(40, 300), nn.Linear(300, 7), nn.LayerNorm(7)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 40, dtype=dtype)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(optimizer.state.values()):
        out |= {f"o{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()}
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _torch_io_unused(monkeypatch):
    """Make torch's own write and read paths fail: the round trip must not fall back to them."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.state_dict as sd

    def boom(*args, **kwargs):
        raise AssertionError("torch's path was used")

    monkeypatch.setattr(fs, "_write_files_from_queue", boom)
    monkeypatch.setattr(fs.FileSystemReader, "read_data", boom)
    monkeypatch.setattr(HuggingFaceStorageReader, "read_data", boom)
    monkeypatch.setattr(sd, "_init_optim_state", lambda optim: None if optim.state else boom())


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_exact(tmp_path, monkeypatch, fmt, dtype, direct):
    if direct:  # every file written past the page cache, in many small regions
        monkeypatch.setattr(filewrite, "DIRECT_MIN", 0)
        monkeypatch.setattr(filewrite, "DIRECT_CHUNK", 8192)
    model, optimizer = model_and_optimizer(0, dtype)
    _torch_io_unused(monkeypatch)
    sharded.save_model(model, tmp_path / "model", registry.get(fmt))
    sharded.save_optimizer(model, optimizer, tmp_path / "optim")
    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    if fmt == "safetensors":
        assert files == ["shard-00001-model-00001-of-00001.safetensors"]
    else:
        assert files == [".metadata", "__0_0.distcp"]
    assert sorted(p.name for p in (tmp_path / "optim").iterdir()) == [".metadata", "__0_0.distcp"]

    fresh_model, fresh_optimizer = model_and_optimizer(1, dtype)
    fresh_optimizer.state.clear()  # a resume: the optimizer has no state yet
    # the reads land in the parameters themselves: nothing is copied afterwards
    monkeypatch.setattr(sharded, "set_model_state_dict", lambda *a, **k: pytest.fail("copied after the load"))
    sharded.load_model(fresh_model, tmp_path / "model", registry.get(fmt))
    sharded.load_optimizer(fresh_model, fresh_optimizer, tmp_path / "optim")
    assert same(values(fresh_model, fresh_optimizer), values(model, optimizer))


def test_a_state_not_loaded_in_place_is_set_into_the_model():
    model, _ = model_and_optimizer(0)
    state = sharded.get_model_state_dict(model)
    assert sharded._loaded_in_place(model, state)
    state["0.weight"] = state["0.weight"].clone()
    assert not sharded._loaded_in_place(model, state)
    del state["0.weight"]
    assert not sharded._loaded_in_place(model, state)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_reads_our_files_and_we_read_torchs(tmp_path, fmt):
    model, _ = model_and_optimizer(0)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}

    sharded.save_model(model, tmp_path / "ours", registry.get(fmt))  # ours -> torch's reader
    state = {k: torch.zeros_like(v) for k, v in expected.items()}
    reader = HuggingFaceStorageReader(str(tmp_path / "ours")) if fmt == "safetensors" else \
        FileSystemReader(str(tmp_path / "ours"))
    dcp.load(state, storage_reader=reader)
    assert same(state, expected)

    writer = HuggingFaceStorageWriter(str(tmp_path / "torch"), save_distributed=True) if fmt == "safetensors" \
        else FileSystemWriter(str(tmp_path / "torch"))
    dcp.save(expected, storage_writer=writer)  # torch's writer -> ours
    fresh, _ = model_and_optimizer(1)
    sharded.load_model(fresh, tmp_path / "torch", registry.get(fmt))
    assert same({k: v.detach() for k, v in fresh.state_dict().items()}, expected)


def test_safetensors_shard_is_a_valid_safetensors_file(tmp_path):
    from safetensors import safe_open

    model, _ = model_and_optimizer(0, torch.bfloat16)
    sharded.save_model(model, tmp_path / "m", registry.get("safetensors"))
    with safe_open(str(tmp_path / "m" / "shard-00001-model-00001-of-00001.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
        assert f.metadata()["format"] == "pt" and "DCP_SHARDING_INFO" in f.metadata()
        for k, v in model.state_dict().items():
            assert torch.equal(f.get_tensor(k), v)


def test_checksums_are_computed_while_writing(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer(0)
    written = durable.WrittenFiles()  # owned by the checkpointer in a run
    sharded.save_model(model, tmp_path / "model", registry.get("safetensors"), written=written)
    sharded.save_optimizer(model, optimizer, tmp_path / "optim", written=written)
    algorithm = manifest.default_algorithm()
    for f in ["model/shard-00001-model-00001-of-00001.safetensors", "optim/__0_0.distcp", "optim/.metadata"]:
        known = written.get(tmp_path / f)
        assert known is not None and known.synced and known.algorithm == algorithm
        assert known.digest == manifest.hash_file(tmp_path / f, algorithm)[1]
    assert durable.WrittenFiles().get(tmp_path / "optim" / "__0_0.distcp") is None  # no process-wide registry

    hashed = []
    real = manifest.hash_file
    monkeypatch.setattr(manifest, "hash_file", lambda p, a: hashed.append(Path(p).name) or real(p, a))
    manifest.seal(tmp_path, 0, 1, written)
    assert hashed == []  # no file read back, the DCP ``.metadata`` included (hashed as it was written)
    assert manifest.verify_manifest(tmp_path).ok
    assert written.get(tmp_path / "optim" / "__0_0.distcp") is None  # forgotten once sealed


def test_a_changed_file_is_never_trusted(tmp_path):
    written = durable.WrittenFiles()
    file = tmp_path / "a.bin"
    file.write_bytes(b"first")
    written.note(file, synced=True, algorithm="crc32", digest="0")
    assert written.get(file) is not None
    file.write_bytes(b"changed")
    assert written.get(file) is None


def test_fsync_tree_skips_files_synced_by_their_writer(tmp_path, monkeypatch):
    model, _ = model_and_optimizer(0)
    written = durable.WrittenFiles()
    sharded.save_model(model, tmp_path / "model", registry.get("torch_save"), written=written)
    (tmp_path / "config.yaml").write_text("x: 1\n")
    synced = []
    monkeypatch.setattr(durable, "fsync_file", lambda p: synced.append(Path(p).name))
    durable.fsync_tree(tmp_path, written=written)
    assert synced == ["config.yaml"]


def saved_tensor_file(tmp_path: Path) -> tuple[torch.Tensor, Path, common.Located]:
    """A (6, 5, 4) float tensor stored at offset 24 of a file, and where it lies: what resharded loads read from."""
    torch.manual_seed(0)
    saved = torch.randn(6, 5, 4)
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 24 + saved.numpy().tobytes())
    return saved, path, common.Located(24, tuple(saved.shape), saved.dtype)


def test_partial_reads_of_every_shape(tmp_path):
    """A resharded load asks for pieces of saved tensors: contiguous runs are read in place, the rest copied."""
    saved, path, located = saved_tensor_file(tmp_path)
    jobs, wants = [], []
    for o0, l0, o1, l1, o2, l2 in itertools.product((0, 2), (1, 4), (0, 1), (1, 5), (0, 3), (1, 4)):
        if o0 + l0 > 6 or o1 + l1 > 5 or o2 + l2 > 4:
            continue
        want = saved[o0:o0 + l0, o1:o1 + l1, o2:o2 + l2]
        jobs.append(readers.ReadJob(str(path), located, (o0, o1, o2), (l0, l1, l2),
                                         torch.full(want.shape, float("nan"))))
        wants.append(want)
    as_bf16 = torch.empty(2, 5, 4, dtype=torch.bfloat16)  # another dtype: converted like copy_
    jobs.append(readers.ReadJob(str(path), located, (1, 0, 0), (2, 5, 4), as_bf16))
    wants.append(saved[1:3].to(torch.bfloat16))
    readers.run_reads(jobs, threads=3)  # all at once, split across threads
    for job, want in zip(jobs, wants):
        assert torch.equal(job.target, want), (job.offsets, job.lengths)
    assert 0 < sum(job.direct for job in jobs) < len(jobs)


def _resident() -> int:
    import re

    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) << 10


def test_scratch_memory_is_given_back_to_the_system_as_soon_as_it_is_dropped():
    before = _resident()
    buffer = common.scratch(64 << 20, torch.uint8)
    buffer.fill_(1)
    assert _resident() - before >= 60 << 20
    del buffer
    assert _resident() - before < 8 << 20


@pytest.mark.parametrize("read_mode", ["force", "off"])  # past the page cache in regions, or preadv
def test_pieces_not_read_in_place_are_staged_on_scratch_memory(tmp_path, monkeypatch, read_mode):
    """A piece that cannot be read in place (another dtype, as a bf16 base read into fp32 weights; not one run of
    the file) is staged on ``common.scratch`` memory, which the allocator's heap cannot keep after the load."""
    from automodel_ckpt.ondisk.fastio import directread

    monkeypatch.setenv(directread.ENV, read_mode)
    staged = []
    real = common.scratch
    monkeypatch.setattr(common, "scratch", lambda numel, dtype: staged.append((numel, dtype)) or real(numel, dtype))
    saved, path, located = saved_tensor_file(tmp_path)
    jobs = [readers.ReadJob(str(path), located, (1, 0, 0), (2, 5, 4), torch.empty(2, 5, 4, dtype=torch.bfloat16)),
            readers.ReadJob(str(path), located, (0, 1, 0), (6, 2, 4), torch.empty(6, 2, 4)),
            readers.ReadJob(str(path), located, (2, 0, 0), (3, 5, 4), torch.empty(3, 5, 4))]  # in place
    readers.run_reads(jobs, threads=2)
    assert torch.equal(jobs[0].target, saved[1:3].to(torch.bfloat16))
    assert torch.equal(jobs[1].target, saved[:, 1:3]) and torch.equal(jobs[2].target, saved[2:5])
    assert sorted(staged, key=str) == sorted([(40, torch.float32), (48, torch.float32)], key=str)


def test_unrecognised_records_are_loaded_by_torch_load(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer(0)
    sharded.save_optimizer(model, optimizer, tmp_path / "optim")
    monkeypatch.setattr(readers, "locate_record", lambda *a: None)
    monkeypatch.setattr(readers, "noted_location", lambda *a: None)
    fresh, fresh_optimizer = model_and_optimizer(1)
    fresh_optimizer.state.clear()
    sharded.load_optimizer(fresh, fresh_optimizer, tmp_path / "optim")
    assert same(values(model, fresh_optimizer), values(model, optimizer))


def test_records_note_where_their_tensor_lies_and_loads_need_not_look(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer(0)
    sharded.save_optimizer(model, optimizer, tmp_path / "optim")
    sharded.save_model(model, tmp_path / "model", registry.get("torch_save"))
    for folder in ("optim", "model"):
        metadata = sharded._reader(tmp_path / folder, sharded.DCP_FILES).read_metadata()
        noted = 0
        for index, info in metadata.storage_data.items():
            chunk = metadata.state_dict_metadata[index.fqn]
            if not hasattr(chunk, "chunks"):
                continue  # a byte entry
            size = tuple(chunk.chunks[0].sizes)
            fd = os.open(tmp_path / folder / info.relative_path, os.O_RDONLY)
            try:
                found = records.locate_record(fd, info.offset, info.length)
            finally:
                os.close(fd)
            note = records.noted_location(info, (0,) * len(size), size)
            if not all(size):
                assert note is None
                continue
            assert note == found, index.fqn  # what a look inside the record finds
            noted += 1
        assert noted >= 3
    # a load takes the notes: no record is looked inside
    monkeypatch.setattr(readers, "locate_record", lambda *a: pytest.fail("a noted record was looked up"))
    fresh, fresh_optimizer = model_and_optimizer(1)
    fresh_optimizer.state.clear()
    sharded.load_model(fresh, tmp_path / "model", registry.get("torch_save"))
    sharded.load_optimizer(fresh, fresh_optimizer, tmp_path / "optim")
    assert same(values(fresh, fresh_optimizer), values(model, optimizer))


def test_a_note_outside_its_record_or_its_request_is_not_taken():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def info(note):
        i = _StorageInfo("f", 1000, 600)
        setattr(i, records.NOTE, note)
        return i

    good = info((64, (10, 10), torch.float32))
    assert records.noted_location(good, (0, 0), (10, 10)) == common.Located(1064, (10, 10), torch.float32)
    assert records.noted_location(good, (2, 0), (8, 10)) is not None
    assert records.noted_location(good, (2, 0), (9, 10)) is None  # beyond the saved shape
    assert records.noted_location(good, (0,), (10,)) is None  # another rank of shape
    assert records.noted_location(info((201, (10, 10), torch.float32)), (0, 0), (10, 10)) is None  # past the end
    assert records.noted_location(info((-1, (1,), torch.float32)), (0,), (1,)) is None
    assert records.noted_location(info((0, (1,), "float32")), (0,), (1,)) is None
    assert records.noted_location(info((0, (-1,), torch.float32)), (0,), (0,)) is None
    assert records.noted_location(info("anything"), (0,), (1,)) is None
    assert records.noted_location(_StorageInfo("f", 0, 8), (0,), (1,)) is None  # no note: torch's writer


def test_a_load_session_shares_threads_and_buffers_and_leaves_none_behind(tmp_path, monkeypatch):
    import threading

    from automodel_ckpt.ondisk.fastio import directread, session

    monkeypatch.setenv(directread.ENV, "force")  # every file through the page-aligned buffers
    model, optimizer = model_and_optimizer(0)
    sharded.save_model(model, tmp_path / "model", registry.get("torch_save"))
    sharded.save_optimizer(model, optimizer, tmp_path / "optim")
    mapped, readers_seen = [], set()
    real_mmap, real_read = session.mmap.mmap, directread._read_region
    monkeypatch.setattr(session.mmap, "mmap", lambda *a: mapped.append(a) or real_mmap(*a))
    monkeypatch.setattr(directread, "_read_region",
                        lambda *a: readers_seen.add(threading.current_thread()) or real_read(*a))
    fresh, fresh_optimizer = model_and_optimizer(1)
    fresh_optimizer.state.clear()
    with sharded.reading():
        sharded.load_model(fresh, tmp_path / "model", registry.get("torch_save"))
        first = len(mapped)
        sharded.load_optimizer(fresh, fresh_optimizer, tmp_path / "optim")
    assert same(values(fresh, fresh_optimizer), values(model, optimizer))
    assert first > 0 and len(mapped) == first  # the second folder reused the first one's buffers
    assert 0 < len(readers_seen) <= fastio.READ_THREADS  # and its threads
    assert not [t for t in threading.enumerate() if t.name.startswith(session.THREAD_PREFIX)]


def test_contiguous_range():
    assert readers.contiguous_range((6, 5), (2, 0), (3, 5)) == (10, 15)
    assert readers.contiguous_range((6, 5), (2, 1), (1, 3)) == (11, 3)
    assert readers.contiguous_range((6, 5), (2, 1), (2, 3)) is None
    assert readers.contiguous_range((), (), ()) == (0, 1)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(7, 3).t(),  # not contiguous
    lambda: torch.randn(10)[2:5],  # a view into a larger storage
    lambda: torch.tensor(3.5),  # 0-d
    lambda: torch.empty(0, 4),  # empty
    lambda: torch.arange(12, dtype=torch.int64).view(3, 4),
    lambda: torch.randn(5, 5).to(torch.bfloat16),
])
def test_torch_save_records_load_with_torch_load(tmp_path, make):
    tensor = make()
    pieces = records.torch_save_pieces(tensor)
    assert pieces is not None
    filewrite.write_file(tmp_path / "r.pt", pieces, threads=2)
    loaded = torch.load(tmp_path / "r.pt", weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)
    fd = os.open(tmp_path / "r.pt", os.O_RDONLY)
    try:
        located = records.locate_record(fd, 0, os.path.getsize(tmp_path / "r.pt"))
    finally:
        os.close(fd)
    assert located is not None and located.shape == tuple(tensor.shape) and located.dtype == tensor.dtype
    framing = sum(filewrite.piece_length(p) for p in pieces) - tensor.numel() * tensor.element_size()
    assert framing < 700  # the compact record: torch.save's own is about 1,540 bytes


def test_records_too_large_for_zip32_take_torchs_own_template():
    assert records.compact_template(torch.Size([1 << 30]), torch.float32) is None  # 4 GiB: zip64, torch's
    assert records.compact_template(torch.Size([4]), torch.float32) is not None


def test_an_optimizer_folder_of_compact_records_is_read_by_torchs_own_tools(tmp_path):
    """``dcp_to_torch_save`` and ``FileSystemReader`` (``torch.load`` per record) read what the writer wrote."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, optimizer = model_and_optimizer(0)
    staged = sharded.stage_optimizer(model, optimizer, tmp_path / "optim", sharded.HostStager(),
                                     durable.WrittenFiles())
    staged.capture()
    staged.write(None)
    dcp_to_torch_save(tmp_path / "optim", tmp_path / "optim.pt")
    flat = torch.load(tmp_path / "optim.pt", weights_only=True)
    moments = [st["exp_avg_sq"] for st in flat["state"].values()]
    expected = [st["exp_avg_sq"] for st in optimizer.state.values()]
    assert len(moments) == len(expected) == 6
    assert all(any(torch.equal(m, e) for m in moments) for e in expected)


def test_optimizer_state_is_created_without_a_step():
    model, _ = model_and_optimizer(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adamw = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.5)
    assert fastio.init_optimizer_state(adamw)
    assert all(set(adamw.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert same({k: v.detach() for k, v in model.state_dict().items()}, before)  # parameters untouched

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # creates no state before a step
    assert not fastio.init_optimizer_state(sgd)
    assert not sgd.state and all(p.grad is None for p in model.parameters())


def test_failed_optimizer_load_leaves_no_uninitialised_state(tmp_path):
    model, optimizer = model_and_optimizer(0)
    sharded.save_optimizer(model, optimizer, tmp_path / "optim")
    other = nn.Sequential(nn.Linear(40, 300), nn.Linear(300, 8), nn.LayerNorm(8))  # another shape
    fresh = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(Exception):
        sharded.load_optimizer(other, fresh, tmp_path / "optim")
    assert not fresh.state


def test_large_files_go_past_the_page_cache_byte_for_byte_with_their_checksum(tmp_path, monkeypatch):
    from automodel_ckpt.ondisk import checksum, durable

    monkeypatch.setattr(filewrite, "DIRECT_MIN", 0)
    monkeypatch.setattr(filewrite, "DIRECT_CHUNK", 8192)
    calls = []
    real = filewrite._write_direct
    monkeypatch.setattr(filewrite, "_write_direct", lambda *a: calls.append(a[3]) or real(*a))
    torch.manual_seed(0)
    tensors = [torch.randn(5000), torch.randn(3333).to(torch.bfloat16), torch.empty(0), torch.randint(0, 9, (77,))]
    pieces = [b"header" * 17, filewrite.Lazy(tensors[0]), memoryview(bytes(range(256)) * 31),
              filewrite.Lazy(tensors[1]), filewrite.Lazy(tensors[2]), filewrite.Lazy(tensors[3]), b"tail"]
    expected = b"".join(bytes(p) if not isinstance(p, filewrite.Lazy) else p.tensor.numpy().tobytes()
                        if p.tensor.dtype != torch.bfloat16 else p.tensor.view(torch.int16).numpy().tobytes()
                        for p in pieces)
    written = durable.WrittenFiles()
    path = tmp_path / "file.bin"
    assert filewrite.write_file(path, pieces, 3, written) == len(expected)
    assert path.read_bytes() == expected
    noted = written.get(path)
    assert noted.synced and noted.digest == checksum.hash_file(path, noted.algorithm)[1]
    if filewrite._open_direct(path) is not None:  # the filesystem takes O_DIRECT: that path wrote it
        assert calls == [len(expected)]
    # a filesystem that refuses O_DIRECT writes: the same file, written through the page cache
    import errno

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(filewrite, "_write_direct", refuse)
    filewrite.write_file(tmp_path / "again.bin", pieces, 3)
    assert (tmp_path / "again.bin").read_bytes() == expected


def test_a_file_of_a_mebibyte_goes_past_the_page_cache_and_a_smaller_one_through_it(tmp_path, monkeypatch):
    """A model shard of tens of MB written through the page cache cost an async save 0.06 of its 0.15 background CPU
    seconds a checkpoint (the copy into the cache and its writeback), taken from training on busy cores."""
    calls = []
    real = filewrite._write_direct
    monkeypatch.setattr(filewrite, "_write_direct", lambda *a: calls.append(a[3]) or real(*a))
    big, small = torch.randn(1 << 18), torch.randn((1 << 18) - 1024)  # 1 MiB, and 4 KiB under it
    filewrite.write_file(tmp_path / "big.bin", [filewrite.Lazy(big)], 2)
    filewrite.write_file(tmp_path / "small.bin", [filewrite.Lazy(small)], 2)
    assert (tmp_path / "big.bin").read_bytes() == big.numpy().tobytes()
    assert (tmp_path / "small.bin").read_bytes() == small.numpy().tobytes()
    if filewrite._open_direct(tmp_path / "big.bin") is None:
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs): every file goes through the page cache")
    assert calls == [1 << 20]


@pytest.mark.parametrize("hashed", [False, True], ids=["in_place", "hashed_from_buffers"])
def test_the_region_buffers_of_one_file_serve_the_next_without_new_mappings(tmp_path, monkeypatch, hashed):
    """A new mapping's first touch faults in every page: an async save's writes spent more CPU on that than on the
    copies into them (a sync save of 0.25 GB took 0.18 s, not 0.23, once they were kept)."""
    monkeypatch.setattr(filewrite, "DIRECT_MIN", 0)
    monkeypatch.setattr(filewrite, "DIRECT_CHUNK", 8192)
    monkeypatch.setattr(filewrite, "_SPARE", {})
    piece = (_OnAccelerator if hashed else filewrite.Lazy)(torch.randn(20_000))  # 10 regions
    (tmp_path / "probe").touch()
    if (probe := filewrite._open_direct(tmp_path / "probe")) is None:
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs): every file goes through the page cache")
    os.close(probe)
    mapped = []
    real = filewrite.mmap.mmap
    monkeypatch.setattr(filewrite.mmap, "mmap", lambda *a: mapped.append(a) or real(*a))
    for name in ("a.bin", "b.bin", "c.bin"):
        filewrite.write_file(tmp_path / name, [piece], 2)
        assert (tmp_path / name).read_bytes() == piece.tensor.numpy().tobytes()
        assert len(mapped) == (4 if hashed else 2)  # the first file's buffers: 2 x threads, or one a thread
    monkeypatch.setattr(filewrite, "DIRECT_CHUNK", 16384)  # buffers of another size are not handed out
    filewrite.write_file(tmp_path / "d.bin", [piece], 2)
    assert len(mapped) > (4 if hashed else 2)
    assert all(len(kept) <= 4 * filewrite.common.WRITE_THREADS for kept in filewrite._SPARE.values())


class _OnAccelerator(filewrite.Lazy):
    """A tensor whose bytes a checksum thread cannot read in place, as an accelerator's."""

    direct = property(lambda self: False)


def test_an_accelerators_tensors_go_past_the_page_cache_hashed_in_file_order(tmp_path, monkeypatch):
    """Pieces not readable in place (a GPU's) take the O_DIRECT path too: copied into a pool of region buffers,
    hashed from them in file order (more regions than buffers: each buffer reused only once hashed), and the file's
    checksum noted without reading it back. A failed region stops the write with its error, never a hang."""
    from automodel_ckpt.ondisk import checksum, durable

    monkeypatch.setattr(filewrite, "DIRECT_MIN", 0)
    monkeypatch.setattr(filewrite, "DIRECT_CHUNK", 8192)
    torch.manual_seed(0)
    tensors = [torch.randn(50_000), torch.randn(3333).to(torch.bfloat16), torch.randint(0, 9, (77,))]
    pieces = [b"header" * 17, _OnAccelerator(tensors[0]), memoryview(bytes(range(256)) * 31),
              filewrite.Lazy(tensors[1]), _OnAccelerator(tensors[2]), b"tail"]
    expected = b"".join(p.tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(p, filewrite.Lazy)
                        else bytes(p) for p in pieces)
    hashers = []
    real = filewrite._write_direct_hashed
    monkeypatch.setattr(filewrite, "_write_direct_hashed", lambda *a: hashers.append(a[3]) or real(*a))
    written = durable.WrittenFiles()
    path = tmp_path / "file.bin"
    assert filewrite.write_file(path, pieces, 3, written) == len(expected)
    assert path.read_bytes() == expected
    noted = written.get(path)
    if filewrite._open_direct(path) is None:  # a filesystem that refuses O_DIRECT: written and hashed as before
        assert not hashers and noted.digest is None
        return
    assert len(hashers) == 1 and len(expected) // 8192 > 2 * 3  # more regions than the pool's buffers
    assert noted.digest == checksum.hash_file(path, noted.algorithm)[1]

    writes = []
    real_write = filewrite._pwrite_all

    def full_disk(fd, buffers, offset):
        writes.append(offset)
        if len(writes) == 5:
            raise OSError(28, "No space left on device")
        real_write(fd, buffers, offset)

    monkeypatch.setattr(filewrite, "_pwrite_all", full_disk)
    with pytest.raises(OSError, match="No space left"):
        filewrite.write_file(tmp_path / "full.bin", pieces, 3, written)


def test_small_items_apart_go_to_a_second_file_and_load_back_exactly(tmp_path, monkeypatch):
    """``small_apart`` (a run whose nodes each load their own copy): step counts, hyperparameters and small tensors
    in ``__0_1.distcp``, the large ones in ``__0_0.distcp``, each file's checksum noted; the load is exact."""
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setattr(fastio.writers, "SMALL_ITEM_BYTES", 1024)  # the LayerNorm's and last bias's moments: small
    model, optimizer = model_and_optimizer(0)
    written = durable.WrittenFiles()
    staged = sharded.stage_optimizer(model, optimizer, tmp_path / "optim", sharded.HostStager(), written,
                                     small_apart=True)
    staged.capture()
    staged.write(None)
    assert sorted(p.name for p in (tmp_path / "optim").iterdir()) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    where = {}
    for index, info in FileSystemReader(str(tmp_path / "optim")).read_metadata().storage_data.items():
        where.setdefault(info.relative_path, set()).add(index.fqn)
    assert "state.0.weight.exp_avg" in where["__0_0.distcp"] and "state.2.weight.exp_avg" in where["__0_1.distcp"]
    assert any(fqn.endswith(".step") for fqn in where["__0_1.distcp"])
    assert not any(fqn.endswith(".step") or fqn.startswith("param_groups") for fqn in where["__0_0.distcp"])
    for name in ("__0_0.distcp", "__0_1.distcp"):
        known = written.get(tmp_path / "optim" / name)
        assert known is not None and known.digest == manifest.hash_file(tmp_path / "optim" / name,
                                                                         known.algorithm)[1]
    fresh_model, fresh_optimizer = model_and_optimizer(1)
    fresh_optimizer.state.clear()
    fresh_model.load_state_dict(model.state_dict())
    sharded.load_optimizer(fresh_model, fresh_optimizer, tmp_path / "optim")
    assert same(values(fresh_model, fresh_optimizer), values(model, optimizer))


def _mount_type(path) -> str | None:
    """The filesystem type of ``path`` by the mount table (longest mount point above it)."""
    real, best = os.path.realpath(path), (None, -1)
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > best[1]:
                best = (fields[2], len(point))
    return best[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/mounts"), reason="needs Linux's mount table")
def test_memory_filesystems_are_told_apart(tmp_path):
    from automodel_ckpt.ondisk.fastio import common

    for path in [tmp_path, *(p for p in ("/dev/shm", "/run") if os.path.isdir(p))]:
        assert common.memory_backed(path) == (_mount_type(path) in ("tmpfs", "ramfs")), path
    assert not common.memory_backed(tmp_path / "missing")


def test_files_in_memory_are_written_from_the_tensors_not_through_o_direct(tmp_path, monkeypatch):
    from automodel_ckpt.ondisk import checksum, durable
    from automodel_ckpt.ondisk.fastio import common

    monkeypatch.setattr(filewrite, "DIRECT_MIN", 0)
    monkeypatch.setattr(common, "memory_backed", lambda path: True)  # as /dev/shm is
    monkeypatch.setattr(filewrite, "_write_direct", lambda *a: pytest.fail("O_DIRECT on a filesystem in memory"))
    tensors = [torch.randn(5000), torch.arange(300, dtype=torch.int64)]
    written = durable.WrittenFiles()
    path = tmp_path / "file.bin"
    filewrite.write_file(path, [b"head", *map(filewrite.Lazy, tensors)], 2, written)
    assert path.read_bytes() == b"head" + b"".join(t.numpy().tobytes() for t in tensors)
    assert written.get(path).digest == checksum.hash_file(path, written.get(path).algorithm)[1]


def test_a_reading_session_starts_every_reader_thread_when_it_opens():
    """Not one on the first read's critical path: tasks that returned at once let the executor start only the
    first threads (the others started at the first read)."""
    import threading

    from automodel_ckpt.ondisk.fastio import session

    with session.kept(4):
        assert len(session._active.executor._threads) == session._active.threads == 4
    assert not [t for t in threading.enumerate() if t.name.startswith(session.THREAD_PREFIX)]


def test_small_items_lie_together_at_the_start_of_a_ranks_file(tmp_path, monkeypatch):
    """What another rank reads of this rank's file (step counts, hyperparameters, small tensors) is one stretch at
    its start, before every large tensor: one read, not a few bytes between large tensors per item."""
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setattr(fastio.writers, "SMALL_ITEM_BYTES", 1024)
    model, optimizer = model_and_optimizer(0)
    staged = sharded.stage_optimizer(model, optimizer, tmp_path / "optim", sharded.HostStager(), durable.WrittenFiles())
    staged.capture()
    staged.write(None)
    meta = FileSystemReader(str(tmp_path / "optim")).read_metadata()
    small, large = [], []
    for index, info in meta.storage_data.items():
        item = meta.state_dict_metadata[index.fqn]  # one rank: every tensor in one piece
        tiny = not hasattr(item, "size") or math.prod(item.size) * item.properties.dtype.itemsize < 1024
        (small if tiny else large).append(info.offset)
    assert small and large and max(small) < min(large)
