"""Loads past the page cache (fastio.directread): exact round trips through O_DIRECT and the page-cache fallback,
both formats, odd sizes and offsets, empty and many small tensors, other dtypes; checksums computed while reading.

In-process, through a one-rank process group.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from automodel_ckpt.ondisk import checksum
from automodel_ckpt.ondisk.formats import registry, sharded
from automodel_ckpt.ondisk.fastio import directread, readers
from automodel_ckpt.distributed.env import init_distributed
from tests.unit.ondisk.fastio.test_parallel_io import same, saved_tensor_file, values

FORMATS = ("safetensors", "torch_save")
SHM = Path("/dev/shm")


@pytest.fixture(scope="module", autouse=True)
def env():
    return init_distributed()


@pytest.fixture(autouse=True)
def small_regions(monkeypatch):
    """Small regions, so that even a small model spans many of them and every thread."""
    monkeypatch.setattr(directread, "REGION", 3 * 4096)
    monkeypatch.setattr(directread, "GAP", 4096)


class Odd(nn.Module):
    """Parameters and buffers of awkward sizes, dtypes and layouts."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.odd = nn.Parameter(torch.randn(1, 4099, generator=g))  # one element past a page
        self.bf16 = nn.Parameter(torch.randn(37, 13, generator=g).to(torch.bfloat16))
        self.empty = nn.Parameter(torch.empty(0, 5))
        self.small = nn.ParameterList([nn.Parameter(torch.randn(3 + i, generator=g)) for i in range(40)])
        self.register_buffer("ints", torch.randint(-2**31, 2**31 - 1, (1001,), generator=g, dtype=torch.int32))
        self.register_buffer("longs", torch.randint(0, 2**40, (3, 7), generator=g, dtype=torch.int64))
        self.register_buffer("flags", torch.rand(333, generator=g) > 0.5)
        self.register_buffer("scalar", torch.tensor(float(seed)))
        # saved from a non-contiguous view (a transpose): the file holds it contiguous
        self.register_buffer("transposed", torch.randn(19, 23, generator=g).t())


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.numel()], lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    return opt


def _count_direct_reads(monkeypatch) -> list[bool]:
    """Records, per region read, whether it went through an O_DIRECT descriptor."""
    seen: list[bool] = []
    real = directread._read_region

    def spy(file, region, buffer):
        n = real(file, region, buffer)
        seen.append(file.direct_fd is not None and file.direct)
        return n

    monkeypatch.setattr(directread, "_read_region", spy)
    return seen


@pytest.mark.parametrize("mode", ["force", "off"], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_exact(tmp_path, monkeypatch, fmt, mode):
    model = Odd(0)
    opt = _optimizer(model)
    sharded.save_model(model, tmp_path / "model", registry.get(fmt))
    sharded.save_optimizer(model, opt, tmp_path / "optim")
    monkeypatch.setenv(directread.ENV, mode)
    seen = _count_direct_reads(monkeypatch)

    fresh = Odd(1)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.numel()], lr=1e-2)
    sharded.load_model(fresh, tmp_path / "model", registry.get(fmt))
    sharded.load_optimizer(fresh, fresh_opt, tmp_path / "optim")
    assert same(values(fresh, fresh_opt), values(model, opt))
    if mode == "force":
        assert len(seen) > 4 and all(seen)  # every read in regions, past the page cache
    else:
        assert seen == []  # straight into the tensors through the page cache, as before


def test_a_filesystem_that_refuses_o_direct_reads_through_the_page_cache(monkeypatch):
    if not SHM.is_dir() or not hasattr(os, "O_DIRECT"):
        pytest.skip("no /dev/shm")
    folder = Path(os.path.realpath(SHM)) / f"direct-read-{os.getpid()}"
    try:
        model = Odd(0)
        sharded.save_model(model, folder / "model", registry.get("torch_save"))
        try:
            os.close(os.open(folder / "model" / "__0_0.distcp", os.O_RDONLY | os.O_DIRECT))
            pytest.skip("this tmpfs takes O_DIRECT")
        except OSError as exc:
            assert exc.errno == errno.EINVAL
        monkeypatch.setenv(directread.ENV, "force")
        seen = _count_direct_reads(monkeypatch)
        fresh = Odd(1)
        sharded.load_model(fresh, folder / "model", registry.get("torch_save"))
        assert same(values(fresh, _optimizer_empty(fresh)), values(model, _optimizer_empty(model)))
        assert seen and not any(seen)  # regions read, none through O_DIRECT
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _optimizer_empty(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=0.1)


def test_einval_at_read_time_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """Some filesystems accept the O_DIRECT open and refuse the read: the same bytes through the page cache."""
    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    real = directread._pread_into
    refused = []

    def pread(fd, view, offset):
        if fd == getattr(pread, "direct", None):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, view, offset)

    real_fds = directread._File.fds

    def fds(self):
        fd, direct_fd = real_fds(self)
        pread.direct = direct_fd
        return fd, direct_fd

    monkeypatch.setattr(directread, "_pread_into", pread)
    monkeypatch.setattr(directread._File, "fds", fds)
    monkeypatch.setenv(directread.ENV, "force")
    out = torch.zeros(len(data) - 7, dtype=torch.uint8)
    directread.read_files({str(path): [directread.Segment(7, out)]}, threads=1)
    assert bytes(out.numpy()) == data[7:]
    assert refused  # it was tried


def test_einval_at_open_reads_through_the_page_cache(tmp_path, monkeypatch):
    """Where the O_DIRECT open is refused (tmpfs on older kernels): the same bytes, none of them O_DIRECT."""
    data = os.urandom(7 * 4096 + 5)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    real_open = os.open

    def refusing(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(directread.os, "open", refusing)
    monkeypatch.setenv(directread.ENV, "force")
    seen = _count_direct_reads(monkeypatch)
    out = torch.zeros(len(data) - 3, dtype=torch.uint8)
    directread.read_files({str(path): [directread.Segment(3, out)]}, threads=2)
    assert bytes(out.numpy()) == data[3:]
    assert seen and not any(seen)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mode", ["force", "off"])
def test_segments_at_odd_offsets_and_whole_file_checksum(tmp_path, monkeypatch, mode, threads):
    monkeypatch.setenv(directread.ENV, mode)
    data = os.urandom(11 * 4096 + 77)  # a tail that is not a whole page
    path = str(tmp_path / "f.bin")
    Path(path).write_bytes(data)
    spans = [(0, 1), (1, 4095), (4095, 2), (8192, 0), (9000, 3 * 4096 + 5), (len(data) - 77, 77),
             (40000, 1)] + [(20000 + 7 * i, 5) for i in range(200)]  # many small ones, overlapping regions
    outs = [torch.full((n,), 0xAB, dtype=torch.uint8) for _, n in spans]
    h = checksum.hasher(checksum.CRC32)
    got = directread.read_files({path: [directread.Segment(s, o) for (s, _), o in zip(spans, outs)]}, threads,
                                hash_files={path: h})
    for (s, n), o in zip(spans, outs):
        assert bytes(o.numpy()) == data[s:s + n]
    assert got[path] == len(data)  # read whole, once, for its checksum
    assert h.hexdigest() == _crc(data)


def _crc(data: bytes) -> str:
    h = checksum.hasher(checksum.CRC32)
    h.update(data)
    return h.hexdigest()


def test_a_failed_read_stops_every_thread_and_raises(tmp_path, monkeypatch):
    monkeypatch.setenv(directread.ENV, "force")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(20 * 4096))
    out = torch.zeros(20 * 4096, dtype=torch.uint8)
    segments = {str(path): [directread.Segment(0, out)]}
    sizes = {str(path): 40 * 4096}  # claims more than the file holds: a truncated file
    with pytest.raises(OSError, match="unexpected end of file"):
        directread.read_files(segments, 3, sizes=sizes, hash_files={str(path): checksum.hasher(checksum.CRC32)})


def test_partial_reads_go_through_regions_too(tmp_path, monkeypatch):
    """A resharded load: pieces of saved tensors, in place or via a buffer, the same as through the page cache."""
    import itertools

    monkeypatch.setenv(directread.ENV, "force")
    saved, path, located = saved_tensor_file(tmp_path)
    jobs, wants = [], []
    for o0, l0, o1, l1 in itertools.product((0, 2), (1, 4), (0, 1), (1, 4)):
        want = saved[o0:o0 + l0, o1:o1 + l1, :]
        jobs.append(readers.ReadJob(str(path), located, (o0, o1, 0), (l0, l1, 4), torch.full(want.shape, float("nan"))))
        wants.append(want)
    as_bf16 = torch.empty(2, 5, 4, dtype=torch.bfloat16)  # another dtype: converted like copy_
    jobs.append(readers.ReadJob(str(path), located, (1, 0, 0), (2, 5, 4), as_bf16))
    wants.append(saved[1:3].to(torch.bfloat16))
    seen = _count_direct_reads(monkeypatch)
    readers.run_reads(jobs, threads=3)
    for job, want in zip(jobs, wants):
        assert torch.equal(job.target, want), (job.offsets, job.lengths)
    assert seen and all(seen)
    assert 0 < sum(job.direct for job in jobs) < len(jobs)  # some in place, some through a buffer


# --- verify_on_load: checksums computed while the files are read ---------------------------------------------


def _saved(tmp_path: Path, fmt: str):
    from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
    from automodel_ckpt.checkpoint.config import CheckpointConfig
    from tests.unit.checkpoint.ckpt_state import State

    cfg = CheckpointConfig(checkpoint_dir=str(tmp_path / "ck"), model_save_format=fmt, save_consolidated="false",
                           verify_on_load=True)
    ckpt = Checkpointer(cfg, init_distributed(), resolved_config_yaml="seed: 1\n", say=lambda _msg: None)
    state = State(hidden=64, layers=3)
    state.step()
    path = ckpt.save(state.states(), SaveInfo(epoch=0, step=1, train_loss=1.0, val_loss=None, is_final=False))
    return ckpt, state, path


def _data_files(path: Path) -> list[str]:
    from automodel_ckpt.ondisk import loadcheck, manifest

    return sorted(rel for rel in manifest.read_manifest(path)["files"] if loadcheck.deferred(rel))


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_on_load_hashes_the_data_files_while_loading_them(tmp_path, monkeypatch, fmt):
    from automodel_ckpt.ondisk import loadcheck, manifest
    from tests.unit.checkpoint.ckpt_state import State

    ckpt, state, path = _saved(tmp_path, fmt)
    data = _data_files(path)
    assert len(data) == 2  # the model's and the optimizer's
    hashed_whole, hashed_on_read = [], []
    for mod in (manifest, loadcheck):
        real = mod.hash_file
        monkeypatch.setattr(mod, "hash_file", lambda p, a, real=real: hashed_whole.append(Path(p)) or real(p, a))
    real_read = directread.read_files
    monkeypatch.setattr(directread, "read_files", lambda segments, threads, **kw: hashed_on_read.extend(
        kw.get("hash_files") or {}) or real_read(segments, threads, **kw))

    fresh = State(hidden=64, layers=3, seed=5)
    ckpt.load(fresh.states(), path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), state.model.parameters()))
    assert sorted(Path(p).relative_to(path.resolve()).as_posix() for p in hashed_on_read) == data
    assert not [p for p in hashed_whole if p.relative_to(path).as_posix() in data]  # not read a second time
    assert hashed_whole  # the small files still are hashed before loading

    # a flipped byte in tensor data: found by the load, one line naming the file
    rel = data[0]
    raw = bytearray((path / rel).read_bytes())
    raw[-50] ^= 0xFF
    (path / rel).write_bytes(bytes(raw))
    with pytest.raises(loadcheck.DamagedFile) as err:
        ckpt.load(State(hidden=64, layers=3).states(), path)
    assert "\n" not in str(err.value) and rel in str(err.value) and "checksum mismatch" in str(err.value)


def test_verify_on_load_checks_data_files_no_load_read(tmp_path):
    """A state not loaded (load_only): its files are still checked, at the end of the load."""
    from automodel_ckpt.ondisk import loadcheck
    from tests.unit.checkpoint.ckpt_state import State

    ckpt, _state, path = _saved(tmp_path, "safetensors")
    optim = next(rel for rel in _data_files(path) if rel.endswith(".distcp"))
    raw = bytearray((path / optim).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (path / optim).write_bytes(bytes(raw))
    only_model = {"model": State(hidden=64, layers=3).model}
    with pytest.raises(loadcheck.DamagedFile, match="checksum mismatch"):
        ckpt.load(only_model, path)


def test_on_a_nodes_own_copy_the_load_checks_every_file_it_reads_and_no_other(tmp_path, monkeypatch):
    """The node-local tier (a run folder that is not shared): each node loads its own copy, so each rank hashes
    every data file its load reads from, while reading it, and leaves the files no load of it reads."""
    from automodel_ckpt.ondisk import loadcheck
    from tests.unit.checkpoint.ckpt_state import State

    ckpt, state, path = _saved(tmp_path, "torch_save")
    monkeypatch.setattr(ckpt._run, "shared", False)
    model_file, optim_file = (next(rel for rel in _data_files(path) if rel.startswith(d)) for d in ("model", "optim"))
    hashed_on_read: list[str] = []
    real_read = directread.read_files
    monkeypatch.setattr(directread, "read_files", lambda segments, threads, **kw: hashed_on_read.extend(
        kw.get("hash_files") or {}) or real_read(segments, threads, **kw))
    raw = bytearray((path / optim_file).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the optimizer's file is damaged, but not read by a load of the model alone
    (path / optim_file).write_bytes(bytes(raw))

    fresh = State(hidden=64, layers=3, seed=5)
    ckpt.load({"model": fresh.model}, path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), state.model.parameters()))
    assert [Path(p).relative_to(path.resolve()).as_posix() for p in hashed_on_read] == [model_file]
    with pytest.raises(loadcheck.DamagedFile, match="checksum mismatch"):  # read: checked
        ckpt.load(State(hidden=64, layers=3).states(), path)


def test_a_reads_only_check_hashes_at_the_end_what_was_read_but_not_hashed(tmp_path):
    """A load that fell back to torch's reader read a file without hashing it: ``finish`` hashes it then."""
    from automodel_ckpt.ondisk import loadcheck

    _ckpt, _state, path = _saved(tmp_path, "torch_save")
    model_file, optim_file = (next(rel for rel in _data_files(path) if rel.startswith(d)) for d in ("model", "optim"))
    for rel in (model_file, optim_file):
        raw = bytearray((path / rel).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (path / rel).write_bytes(bytes(raw))
    check = loadcheck.LoadCheck.of_reads(path)
    check.hashers(path / "optim")  # the optimizer folder's load read nothing: no file of it is checked
    check.finish()
    check = loadcheck.LoadCheck.of_reads(path)
    assert check.hashers(path / "model", [str(path / model_file)])
    with pytest.raises(loadcheck.DamagedFile, match=model_file):
        check.finish()


def _finishes(fn) -> BaseException | None:
    """Runs ``fn`` on a thread; the exception it raised. Fails the test if it has not returned within a minute."""
    import threading

    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            out[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "read_files hung"
    return out[0]


@pytest.mark.parametrize("fail_at", ["reader", "hasher"])
def test_a_failure_while_hashing_never_hangs(tmp_path, monkeypatch, fail_at):
    """An early region fails while later ones wait for the hasher (or the hasher fails): every thread stops."""
    monkeypatch.setenv(directread.ENV, "force")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(40 * 4096))
    real = directread._read_region

    def failing(file, region, buffer):
        if fail_at == "reader" and region.lo == 3 * 4096:
            raise OSError(errno.EIO, "Input/output error")
        return real(file, region, buffer)

    class BadHasher:
        def update(self, data):
            raise ValueError("hasher broke")

    monkeypatch.setattr(directread, "_read_region", failing)
    monkeypatch.setattr(directread, "REGION", 4096)
    hasher = BadHasher() if fail_at == "hasher" else checksum.hasher(checksum.CRC32)
    out = torch.zeros(40 * 4096, dtype=torch.uint8)
    error = _finishes(lambda: directread.read_files({str(path): [directread.Segment(0, out)]}, 3,
                                                    hash_files={str(path): hasher}))
    assert isinstance(error, OSError if fail_at == "reader" else ValueError)


def test_a_target_off_the_cpu_that_holds_the_saved_bytes_is_copied_into_from_the_read_buffers():
    """A GPU's tensor (here: the meta device) whose dtype and shape are the saved piece's gets the read buffers'
    bytes copied straight into it: no buffer of its own first (which cost a fault-in and a copy per byte)."""
    from automodel_ckpt.ondisk.fastio.common import Located

    saved = Located(4096, (8, 4), torch.float32)
    job = readers.ReadJob("f", saved, (0, 0), (8, 4), torch.empty(8, 4, device="meta"))
    assert job.in_place and not job.direct  # no preadv into it: it is not host memory
    segment = job.segment()
    assert segment.make is None and segment.dest.device.type == "meta"
    assert (segment.start, segment.nbytes) == (4096, 128)
    for other in (torch.empty(8, 4, dtype=torch.bfloat16, device="meta"),  # another dtype: cast from a buffer
                  torch.empty(4, 8, device="meta").t()):  # not contiguous
        job = readers.ReadJob("f", saved, (0, 0), (8, 4), other)
        assert not job.in_place and job.segment().make is not None
    rows = readers.ReadJob("f", saved, (2, 0), (3, 4), torch.empty(3, 4, device="meta"))  # a block of rows
    assert rows.in_place and (rows.segment().start, rows.segment().nbytes) == (4096 + 32, 48)


@pytest.mark.parametrize("pinned", [False, True])
def test_the_direct_write_buffers_are_page_aligned(pinned):
    """Pinned for a GPU's tensors where an accelerator is there, an anonymous mapping otherwise: aligned either way."""
    from automodel_ckpt.ondisk.fastio import filewrite

    view, tensor = filewrite._chunk_buffer(pinned)
    assert view.nbytes == tensor.numel() == filewrite.DIRECT_CHUNK
    assert tensor.data_ptr() % 4096 == 0
    view[:3] = b"abc"
    assert bytes(tensor[:3].tolist()) == b"abc"  # one memory


def test_regions_of_a_few_small_items_are_read_before_the_large_ones(tmp_path, monkeypatch):
    """Another rank's step counts (a few bytes each, gathered in a few pages) are read first, while the device's
    queue is short, not last behind every large read; the rest keeps its file order; hashed files keep theirs."""
    monkeypatch.setattr(directread, "REGION", 64 << 10)
    monkeypatch.setattr(directread, "SMALL_REGION", 16 << 10)
    monkeypatch.setenv(directread.ENV, "force")
    large, small, hashed = (str(tmp_path / name) for name in ("a_large.bin", "b_small.bin", "c_hashed.bin"))
    for path, size in ((large, 256 << 10), (small, 256 << 10), (hashed, 128 << 10)):
        Path(path).write_bytes(os.urandom(size))
    order: list[tuple[str, int]] = []
    real = directread._read_region

    def reading(file, region, buffer):
        order.append((Path(file.path).name, region.lo))
        return real(file, region, buffer)

    monkeypatch.setattr(directread, "_read_region", reading)
    outs = {large: torch.empty(256 << 10, dtype=torch.uint8), small: torch.empty(8, dtype=torch.uint8)}
    h = checksum.hasher(checksum.CRC32)
    segments = {large: [directread.Segment(0, outs[large])], small: [directread.Segment(200 << 10, outs[small])]}
    directread.read_files(segments, threads=1, hash_files={hashed: h})
    assert order == [("b_small.bin", 200 << 10)] + [("a_large.bin", k << 16) for k in range(4)] + \
        [("c_hashed.bin", k << 16) for k in range(2)]
    assert bytes(outs[small].numpy()) == Path(small).read_bytes()[200 << 10:(200 << 10) + 8]
    assert h.hexdigest() == _crc(Path(hashed).read_bytes())
