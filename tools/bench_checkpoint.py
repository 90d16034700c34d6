#!/usr/bin/env python3
"""Benchmark checkpoint save, load and HF export against raw I/O and the usual alternatives, in one run.

A Llama model (fp32) plus its AdamW state (two moments), about ``--size-gb`` in all, is saved and loaded by:

save
* ``raw write``            the same number of bytes written sequentially from memory, fsync at the end
                           (``--nproc`` writers, one file each: what the storage itself can do)
* ``raw write, O_DIRECT``  the same bytes, same threads as ours, bypassing the page cache: what the device
                           itself does (the physical reference; skipped where the filesystem refuses O_DIRECT)
* ``torch.save``           the full (unsharded) model + optimizer state dict in one file, as shipped (no fsync)
* ``torch.save + fsync``   the same, with an fsync of the file: as durable as a checkpoint
* ``dcp.save``             plain ``torch.distributed.checkpoint.save`` of the sharded state, ``FileSystemWriter``
                           defaults (one thread, fsync per file)
* ``ours (safetensors)``   ``Checkpointer.save``: the trainer's real path, model as per-rank safetensors shards,
* ``ours (torch_save)``    or as DCP files; both including fsync, manifest (checksums) and publish

load (the page cache is dropped before every run when permitted: reads come from storage)
* ``raw read``             the same bytes read sequentially into fresh memory of their size, as a load must
                           (``--nproc`` readers, one file each); also with our thread count per reader, and
                           streamed through one reused 64 MB buffer (nothing kept: the storage alone), and
                           with O_DIRECT into fresh memory, same threads as ours (the device's own read)
* ``torch.load``           ``torch.load`` of the torch.save file + ``load_state_dict`` into model and optimizer
* ``dcp.load``             plain ``dcp.load`` (``FileSystemReader``) + ``set_{model,optimizer}_state_dict``
* ``ours (...)``           ``Checkpointer.load`` (resume: model, optimizer, scheduler, RNG; manifest size check)

HF export of the safetensors checkpoint's model shards into one ``model.safetensors`` (page cache dropped first, too)
* ``ours``                 ``automodel_ckpt.export.plan.consolidate`` (fsyncs its output)
* ``torch's``              ``consolidate_safetensors_files`` as shipped (no fsync), and ``torch's + fsync``

archive (``--only archive``; the export above and its archive made once, page cache dropped before each run)
* ``pack``                 ``ckpt-train pack`` of the export folder into one tar (fsync): against the export itself
* ``restore_from``         the model's weights read by ``restore_from`` (``load_hf_folder``, one rank) from the export
                           folder, and from its archive in place: the archive against the folder

Every run is a fresh process (``torch.distributed.run`` with ``--nproc 2``: gloo, FSDP2 ``fully_shard`` as in the
trainer); repetitions are interleaved, rotating the order. ``--background-load N`` keeps N busy processes (a Python
loop each) running during every timed run, references included: the ratios under a loaded machine. Prints a markdown table (median, min, max, GB/s,
ratio to raw, memory the operation adds on rank 0) and writes JSON (``--json``). ``--only async`` (default with
``--device cuda``) also times ``checkpoint.is_async`` saves: how long training is blocked, and until published.
``--mesh`` (4 ranks) times save and load on dp 4, dp 2 × tp 2 and HSDP 2 × 2 side by side (``tools/bench_mesh.py``).

    python tools/bench_checkpoint.py --dir /path/on/your/storage --size-gb 1 --nproc 1 --reps 5 --json out.json

Times internals: imports ``ondisk.fastio`` (the parallel I/O's thread counts its raw I/O uses) directly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_mesh, bench_resume beside this file

HIDDEN, INTER, VOCAB, HEADS = 1024, 2816, 4096, 16
BLOCK = 64 << 20  # raw I/O block

SAVE = ("raw_write", "raw_write_mt", "raw_write_direct", "torch_save", "dcp_save", "ours_save_safetensors", "ours_save_torch_save")
LOAD = ("raw_read", "raw_read_mt", "raw_read_direct", "raw_read_stream", "torch_load", "dcp_load", "ours_load_safetensors",
        "ours_load_torch_save")
EXPORT = ("ours_consolidate", "torch_consolidate")
ARCHIVE = ("ours_pack", "restore_from_folder", "restore_from_archive")
ASYNC = ("ours_async_save_safetensors", "ours_async_save_torch_save")
LABELS = {
    "raw_write": "raw write + fsync",
    "raw_write_mt": "raw write + fsync, same threads as ours",
    "raw_write_direct": "device write (O_DIRECT) + fsync, same threads as ours",
    "torch_save": "torch.save",
    "torch_save+fsync": "torch.save + fsync",
    "dcp_save": "dcp.save (FileSystemWriter defaults)",
    "ours_save_safetensors": "**ours, safetensors**",
    "ours_save_torch_save": "**ours, torch_save**",
    "raw_read": "raw read into memory",
    "raw_read_mt": "raw read into memory, same threads as ours",
    "raw_read_direct": "device read (O_DIRECT) into memory, same threads as ours",
    "raw_read_stream": "raw read through a reused 64 MB buffer",
    "torch_load": "torch.load + load_state_dict",
    "dcp_load": "dcp.load + set_state_dict",
    "ours_load_safetensors": "**ours, safetensors**",
    "ours_load_torch_save": "**ours, torch_save**",
    "ours_consolidate": "**ours** (fsync)",
    "torch_consolidate": "torch's consolidate_safetensors_files",
    "torch_consolidate+fsync": "torch's + fsync",
    "ours_pack": "**ours**: `ckpt-train pack` of the export folder (fsync)",
    "restore_from_folder": "restore_from the export folder",
    "restore_from_archive": "**restore_from the archive, in place**",
    "ours_async_save_safetensors": "ours async, safetensors: training blocked (save call + fence wait)",
    "ours_async_save_safetensors+total": "ours async, safetensors: until published",
    "ours_async_save_safetensors+fence": "ours async, safetensors: of which the next optimizer step waited at the fence",
    "ours_async_save_safetensors+step": "ours async, safetensors: the next step (forward, backward, optimizer step)",
    "ours_async_save_safetensors+capture": "ours async, safetensors: background copy of the state",
    "ours_async_save_torch_save": "ours async, torch_save: training blocked (save call + fence wait)",
    "ours_async_save_torch_save+total": "ours async, torch_save: until published",
    "ours_async_save_torch_save+fence": "ours async, torch_save: of which the next optimizer step waited at the fence",
    "ours_async_save_torch_save+step": "ours async, torch_save: the next step (forward, backward, optimizer step)",
    "ours_async_save_torch_save+capture": "ours async, torch_save: background copy of the state",
}


# ---------------------------------------------------------------------------------------------- the state
def layers_for(size_gb: float) -> int:
    """Decoder layers so that fp32 params + two AdamW moments are about ``size_gb``."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    fixed = 2 * VOCAB * HIDDEN + HIDDEN
    return max(1, round((size_gb * 1e9 / 12 - fixed) / per_layer))


def llama_config(layers: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    return cfg


def payload_bytes(layers: int) -> tuple[int, int]:
    """(model bytes, model + optimizer bytes) of the fp32 state: params, two moments, one 4-byte step each."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(layers))
    params = list(model.parameters())
    model_bytes = sum(p.numel() * 4 for p in params)
    return model_bytes, 3 * model_bytes + 4 * len(params)


class Progress:
    """A small global object (written once, by rank 0)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def dist_env(device: str):
    """Join the group (one rank without a launcher), as the trainer does; returns our ``DistEnv``."""
    import torch
    import torch.distributed as dist

    from automodel_ckpt.distributed.env import DistEnv, init_distributed

    env = init_distributed("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    dev = torch.device("cuda", env.local_rank) if device == "cuda" else torch.device("cpu")
    return DistEnv(dist.get_rank(), dist.get_world_size(), env.local_rank, dev, env.backend)


def build_state(layers: int, env, *, sharded: bool = True, with_moments: bool = True, dims=None) -> dict:
    """Model (FSDP2-sharded like the trainer's; ``dims``: on that mesh) + AdamW (moments materialised) + the small
    objects."""
    import torch
    from transformers import LlamaForCausalLM

    from automodel_ckpt.training.rng import RNGState

    torch.manual_seed(0)
    with torch.device("meta"):  # random values without the (slow, untimed) default initialisation
        model = LlamaForCausalLM(llama_config(layers)).float()
    model.to_empty(device=env.device)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    if sharded:
        from automodel_ckpt.distributed.fsdp import data_parallel_mesh, shard_model

        shard_model(model, dims if dims is not None else data_parallel_mesh(env.device, env.world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=100)
    if with_moments:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3  # moments of real-looking (incompressible) values
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "progress": Progress(),
            "rng": RNGState()}


def checkpointer(env, root: Path, fmt: str, is_async: bool = False, dims=None):
    from automodel_ckpt.checkpoint import CheckpointConfig, Checkpointer

    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated="false",
                           is_async=is_async)
    extra = {"dims": dims} if dims is not None else {}  # a --baseline-tree may predate meshes
    return Checkpointer(cfg, env, resolved_config_yaml="# bench_checkpoint\n", say=lambda _m: None, **extra)


# ---------------------------------------------------------------------------------------------- raw I/O
def _fsync_file(path: Path) -> None:
    # imported late: --tree may pick another checkout, whose modules may sit elsewhere (no public face before 0.6)
    _from_tree("fsync_file", "automodel_ckpt.ondisk", "automodel_ckpt.checkpoint.disk.durable",
               "automodel_ckpt.checkpoint.storage")(path)


def _from_tree(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that the checkout being measured has (its public face first)."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {modules} has {name}")


def _parallel(fn, n: int) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _pieces(size: int, threads: int) -> list[list[tuple[int, int]]]:
    """``(offset, length)`` pieces of ``BLOCK`` bytes dealt round-robin to ``threads`` threads."""
    pieces = [(o, min(BLOCK, size - o)) for o in range(0, size, BLOCK)]
    return [pieces[t::threads] for t in range(threads)]


ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in multiples of this


def _aligned_buffer(n: int) -> memoryview:
    """``n`` bytes of fresh, page-aligned memory (an anonymous mapping; pages are faulted in when first touched)."""
    import mmap

    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


def direct_io_supported(folder: Path) -> bool:
    """Whether files in ``folder`` can be opened with O_DIRECT (tmpfs and some others refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / ".o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _io_range(direct_fd: int | None, fd: int, op, buf: memoryview, offset: int, length: int) -> None:
    """``op`` (``os.pwritev`` or ``os.preadv``) over ``[offset, offset + length)`` of the file from ``buf``: the
    aligned part through ``direct_fd`` when given, the unaligned tail through ``fd``."""
    head = length // ALIGN * ALIGN if direct_fd is not None and offset % ALIGN == 0 else 0
    for descriptor, start, end in ((direct_fd, 0, head), (fd, head, length)):
        done = start
        while done < end:
            n = op(descriptor, [buf[done:end]], offset + done)
            if n == 0:
                raise OSError("unexpected end of file")
            done += n


def raw_write(folder: Path, nbytes: int, writers: int, threads: int = 1, direct: bool = False) -> None:
    """``writers`` files (one per rank) of ``nbytes`` in all, each written by ``threads`` threads, then fsynced.

    ``direct``: through O_DIRECT (the page cache bypassed), from page-aligned memory.
    """
    block = _aligned_buffer(BLOCK)
    block[:] = os.urandom(BLOCK)
    folder.mkdir(parents=True, exist_ok=True)
    share = -(-nbytes // writers)
    share = -(-share // ALIGN) * ALIGN if direct else share

    def one(i: int) -> None:
        size = max(0, min(share, nbytes - i * share))
        file = folder / f"raw_{i}.bin"
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        dfd = os.open(file, os.O_WRONLY | os.O_DIRECT) if direct else None
        try:
            def part(t: int, todo=_pieces(size, threads)) -> None:
                for offset, length in todo[t]:
                    _io_range(dfd, fd, os.pwritev, block, offset, length)

            _parallel(part, threads)
            for descriptor in (dfd, fd):
                if descriptor is not None:
                    os.fsync(descriptor)
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    _parallel(one, writers)


def raw_read(folder: Path, readers: int, threads: int = 1, keep: bool = True, direct: bool = False) -> int:
    """Read the raw files (one reader per file), each with ``threads`` threads taking one consecutive stretch with
    a descriptor of its own (as ours). ``keep``: into fresh memory of the file's size, as a load must (its pages are
    faulted in by the read); else through a reused ``BLOCK`` buffer, keeping nothing. ``direct``: through
    O_DIRECT, into page-aligned memory."""
    import numpy as np

    files = sorted(folder.glob("raw_*.bin"))
    total = [0] * len(files)
    lock = threading.Lock()

    def one(i: int) -> None:
        size = os.path.getsize(files[i])
        if keep:  # untouched until read into
            dest = _aligned_buffer(size) if direct else memoryview(np.empty(size, dtype=np.uint8))
        span = -(-size // threads)
        span = -(-span // ALIGN) * ALIGN if direct else span

        def part(t: int) -> None:
            buf = None if keep else _aligned_buffer(BLOCK)
            fd = os.open(files[i], os.O_RDONLY)
            dfd = os.open(files[i], os.O_RDONLY | os.O_DIRECT) if direct else None
            try:
                offset, end = t * span, min(size, (t + 1) * span)
                while offset < end:
                    length = min(BLOCK, end - offset)
                    target = dest[offset:offset + length] if keep else buf[:length]
                    _io_range(dfd, fd, os.preadv, target, offset, length)
                    offset += length
                    with lock:
                        total[i] += length
            finally:
                os.close(fd)
                if dfd is not None:
                    os.close(dfd)

        _parallel(part, threads)

    _parallel(one, len(files))
    return sum(total)


# ---------------------------------------------------------------------------------------------- children
class _RSSSampler(threading.Thread):
    """Samples this process's resident memory every few milliseconds during the timed operation."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.base = self.peak = _rss()

    def run(self) -> None:
        while not self.stop_event.wait(0.005):
            self.peak = max(self.peak, _rss())

    def extra_mb(self) -> float:
        self.stop_event.set()
        self.join()
        return (max(self.peak, _rss()) - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_SAMPLER: list[_RSSSampler] = []


def _start_timing() -> float:
    """Start the memory sampler; the start time of the timed operation."""
    if not _SAMPLER and os.path.exists("/proc/self/statm"):
        _SAMPLER.append(_RSSSampler())
        _SAMPLER[0].start()
    return time.perf_counter()


def _report(result: dict) -> None:
    """Print the run's result (with the memory the operation added: peak during it minus before it)."""
    result["extra_rss_mb"] = _SAMPLER[0].extra_mb() if _SAMPLER else None
    print(json.dumps(result), flush=True)


def child(args: argparse.Namespace) -> None:
    """One timed run in this (fresh) process; rank 0 prints ``{"seconds": ...}`` as its last line."""
    import torch

    method, work, layers = args.child, args.dir, args.layers
    src, out = work / "src", work / "out"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.nproc)))
    result: dict = {}

    if method in ("raw_write", "raw_write_mt", "raw_write_direct"):
        from automodel_ckpt.ondisk.fastio import WRITE_THREADS

        t0 = _start_timing()
        raw_write(out, args.nbytes, args.nproc, 1 if method == "raw_write" else WRITE_THREADS,
                  direct=method == "raw_write_direct")
        result["seconds"] = time.perf_counter() - t0
    elif method in ("raw_read", "raw_read_mt", "raw_read_direct", "raw_read_stream"):
        from automodel_ckpt.ondisk.fastio import READ_THREADS

        t0 = _start_timing()
        result["bytes_read"] = raw_read(src / "raw", args.nproc, 1 if method in ("raw_read", "raw_read_stream")
                                        else READ_THREADS, keep=method != "raw_read_stream",
                                        direct=method == "raw_read_direct")
        result["seconds"] = time.perf_counter() - t0
    elif method in ("torch_save", "torch_load"):
        from automodel_ckpt.distributed.env import DistEnv

        env = DistEnv(0, 1, 0, torch.device(args.device if args.device == "cpu" else "cuda:0"), "none")
        states = build_state(layers, env, sharded=False, with_moments=method == "torch_save")
        model, optimizer = states["model"], states["optimizer"]
        if method == "torch_save":
            out.mkdir(parents=True)
            file = out / "state.pt"
            t0 = _start_timing()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, file)
            t1 = time.perf_counter()
            _fsync_file(file)
            result |= {"seconds": t1 - t0, "seconds_fsync": time.perf_counter() - t0}
        else:
            t0 = _start_timing()
            loaded = torch.load(src / "torch_save" / "state.pt", map_location=env.device, weights_only=True)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            result["seconds"] = time.perf_counter() - t0
    else:
        import torch.distributed as dist

        env = dist_env(args.device)
        states = build_state(layers, env, with_moments=not method.endswith("_load") and "_load_" not in method)
        model, optimizer = states["model"], states["optimizer"]
        dist.barrier()
        if method == "dcp_save":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            t0 = _start_timing()
            dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                     storage_writer=FileSystemWriter(str(out)))
            dist.barrier()
            result["seconds"] = time.perf_counter() - t0
        elif method == "dcp_load":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemReader
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            t0 = _start_timing()
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, storage_reader=FileSystemReader(str(src / "dcp_save")))
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            dist.barrier()
            result["seconds"] = time.perf_counter() - t0
        elif method.startswith("ours_save_"):
            from automodel_ckpt.checkpoint import SaveInfo

            fmt = method[len("ours_save_"):]
            ckpt = checkpointer(env, out, fmt)
            info = SaveInfo(epoch=0, step=1, train_loss=1.0, val_loss=1.0, is_final=False)
            dist.barrier()
            t0 = _start_timing()
            ckpt.save(states, info)
            result["seconds"] = time.perf_counter() - t0
        elif method.startswith("ours_async_save_"):
            from automodel_ckpt.checkpoint import SaveInfo

            fmt = method[len("ours_async_save_"):]
            ckpt = checkpointer(env, out, fmt, is_async=True)
            ckpt.save(states, SaveInfo(epoch=0, step=1, train_loss=1.0, val_loss=1.0, is_final=False))
            ckpt.wait()  # the first save allocates the staging buffers; the measured one reuses them
            batch = torch.randint(0, VOCAB, (1, 128), device=env.device)
            dist.barrier()
            t0 = _start_timing()
            ckpt.save(states, SaveInfo(epoch=0, step=2, train_loss=1.0, val_loss=1.0, is_final=False))
            call = time.perf_counter() - t0
            job = ckpt.stats.background  # the next training step, while the state is copied in the background:
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()  # waits at the fence for what is not copied yet
            optimizer.zero_grad(set_to_none=True)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            step = time.perf_counter() - t0 - call
            ckpt.finalize()
            dist.barrier()
            result |= {"seconds": call + job.fence_seconds, "seconds_total": time.perf_counter() - t0,
                       "seconds_call": call, "seconds_fence": job.fence_seconds, "seconds_step": step,
                       "seconds_capture": job.capture_seconds}
        elif method.startswith("ours_load_"):
            fmt = method[len("ours_load_"):]
            root = src / f"ours_save_{fmt}"
            ckpt = checkpointer(env, root, fmt)
            t0 = _start_timing()
            ckpt.load(states, root / "epoch_0_step_1")
            dist.barrier()
            result["seconds"] = time.perf_counter() - t0
        else:
            raise SystemExit(f"unknown method {method}")
        from automodel_ckpt.distributed.env import end_process, shutdown_distributed

        shutdown_distributed()  # NCCL's threads end before the interpreter's (else: a crash at exit)
        if env.rank == 0:
            _report(result)
        end_process(0)  # nor do gloo's: a rank never meets interpreter teardown (see end_process)

    _report(result)


def export_child(args: argparse.Namespace) -> None:
    src = args.dir / "src" / "ours_save_safetensors" / "epoch_0_step_1" / "model"
    out = args.dir / "out"
    if args.child == "ours_consolidate":
        consolidate = _from_tree("consolidate", "automodel_ckpt.ondisk", "automodel_ckpt.checkpoint.export.plan",
                                 "automodel_ckpt.checkpoint.consolidate")

        t0 = _start_timing()
        consolidate(src, out, progress=False)
        _report({"seconds": time.perf_counter() - t0})
        return
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    names: set[str] = set()
    for f in sorted(src.glob("shard-*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    t0 = _start_timing()
    out.mkdir(parents=True)
    consolidate_safetensors_files(str(src), str(out), dict.fromkeys(sorted(names), 1), 5)
    t1 = time.perf_counter()
    for f in sorted(out.iterdir()):
        _fsync_file(f)
    _report({"seconds": t1 - t0, "seconds_fsync": time.perf_counter() - t0})


def archive_child(args: argparse.Namespace) -> None:
    """``ours_pack``: the export folder packed; ``restore_from_*``: its weights loaded into a fresh model."""
    import torch
    import torch.distributed as dist

    src, out = args.dir / "src", args.dir / "out"
    if args.child == "ours_pack":
        from automodel_ckpt.export import pack

        out.mkdir(parents=True)
        t0 = _start_timing()
        pack(src / "export", out / "model.tar", progress=False)
        _report({"seconds": time.perf_counter() - t0})
        return
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.checkpoint import load_hf_folder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = AutoModelForCausalLM.from_config(llama_config(args.layers), dtype=torch.float32)
    target = src / "export" if args.child == "restore_from_folder" else src / "model.tar"
    t0 = _start_timing()
    load_hf_folder(model, target, 0)
    _report({"seconds": time.perf_counter() - t0})


def make_archive_sources(src: Path, layers: int) -> None:
    """The export of the safetensors checkpoint (``src/export``, with the model's config.json) and its archive
    (``src/model.tar``), once."""
    from automodel_ckpt.export import consolidate, pack

    consolidate(src / "ours_save_safetensors" / "epoch_0_step_1" / "model", src / "export", progress=False)
    llama_config(layers).to_json_file(str(src / "export" / "config.json"))
    pack(src / "export", src / "model.tar", progress=False)


# ---------------------------------------------------------------------------------------------- parent
def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def settle(out: Path, drop: bool = False) -> bool:
    """Before a timed run: ``out`` emptied, dirty pages flushed (and the page cache dropped for a run that reads
    from storage: ``drop``), then 1 s for the storage to settle (deleted files' discards, writeback of other
    processes). False when the page cache was to be dropped and could not be."""
    fresh(out)
    dropped = drop_caches() if drop else True
    if not drop:
        os.sync()
    time.sleep(1.0)
    return dropped


BASELINE = "baseline:"  # a method run with the automodel_ckpt of --baseline-tree


class ChildFailed(Exception):
    """A timed child that exited with an error or ran past ``--child-timeout`` (its stderr's tail is the message)."""


def run_child(method: str, args: argparse.Namespace, layers: int, nbytes: int) -> dict:
    """Run one timed child (under ``torch.distributed.run`` when it is distributed). Past ``args.child_timeout``
    seconds its processes get SIGABRT, so that each prints where it stood (``PYTHONFAULTHANDLER``), then SIGKILL."""
    tree = []
    if method.startswith(BASELINE):
        method, tree = method[len(BASELINE):], ["--tree", str(args.baseline_tree)]
    script = [__file__, "--child", method, "--dir", str(args.dir), "--layers", str(layers), "--nbytes", str(nbytes),
              "--ranks", str(args.nproc), "--device", args.device, *tree]
    distributed = method.startswith(("dcp_", "ours_save", "ours_load", "ours_async", "mesh_"))
    if distributed and args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               *script]
    else:
        cmd = [sys.executable, *script]
    spy = os.environ.get("BENCH_SPY")  # "PY_SPY:DIR[:METHOD,...]": those runs sampled by py-spy into DIR/METHOD.txt
    if spy:
        binary, folder, *only = spy.split(":")
        if not only or method in only[0].split(","):
            cmd = [binary, "record", "-r", "50", "--threads", "--nonblocking", "-f", "raw", "-o",
                   str(Path(folder) / f"{method}.txt"), "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc)),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        late = False
        try:
            proc.wait(timeout=getattr(args, "child_timeout", None))
        except subprocess.TimeoutExpired:
            late = True
            _signal_group(proc, signal.SIGABRT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        if late:
            raise ChildFailed(f"{method}: no result after {args.child_timeout:g} s; where it stood:\n"
                              f"{err.read()[-6000:]}")
        if proc.returncode:
            raise ChildFailed(f"{method} failed:\n{err.read()[-4000:]}")
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1])


def _attempt(method: str, label: str, args: argparse.Namespace, layers: int, nbytes: int,
             failed: dict[str, str]) -> dict | None:
    """``run_child``'s result, or None with the failure noted in ``failed`` and printed."""
    try:
        return run_child(method, args, layers, nbytes)
    except ChildFailed as e:
        failed[method] = str(e)
        print(f"  {label} {method}: {e}", flush=True)
        return None


def _source_of(method: str) -> str | None:
    """The save whose files a load method reads (None: not a load)."""
    plain = method.removeprefix(BASELINE)
    if plain not in LOAD:
        return None
    return "raw_write" if plain.startswith("raw_read") else plain.replace("load", "save")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def stats(secs: list[float], nbytes: int) -> dict:
    med = statistics.median(secs)
    return {"median_s": med, "min_s": min(secs), "max_s": max(secs), "gb_per_s": nbytes / 1e9 / med if med > 0 else None,
            "runs_s": secs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_checkpoint",
                   help="where to write (on the storage to measure); emptied first")
    p.add_argument("--size-gb", type=float, default=1.0, help="model + AdamW state, 0.25-4 (16 with --device cuda)")
    p.add_argument("--nproc", type=int, choices=(1, 2, 4), default=1,
                   help="ranks (2 or 4: torch.distributed.run, gloo)")
    p.add_argument("--mesh", action="store_true",
                   help="save and load on dp 4, dp 2 × tp 2 and HSDP 2 × 2 beside raw I/O (4 ranks; --only mesh)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--only", choices=("save", "load", "export", "archive", "async", "resume", "mesh"), nargs="+",
                   default=None,
                   help="groups to run (default: save load export, and async with --device cuda)")
    p.add_argument("--methods", default=None,
                   help="only these of the groups' methods, comma-separated (e.g. raw_write_direct,"
                        "ours_save_safetensors,raw_read_direct,ours_load_safetensors: the device ratios alone)")
    p.add_argument("--json", type=Path, default=None, help="the results (rewritten after each timed run)")
    p.add_argument("--child-timeout", type=float, default=None, metavar="S",
                   help="a run with no result after S seconds is stopped (its stack printed) and the rest go on")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy processes (one Python loop each) running during the timed runs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout of automodel-ckpt (an older version, say): its save and load are timed "
                        "too, interleaved with this one's")
    p.add_argument("--ranks", type=int, help=argparse.SUPPRESS)  # --nproc of a child (torchrun owns --nproc*)
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.nproc = args.ranks or 1
        if args.tree:
            sys.path.insert(0, str(args.tree))
        if args.child.startswith("mesh_"):
            import bench_mesh

            bench_mesh.child(args, sys.modules[__name__])
            return
        (export_child if args.child in EXPORT else archive_child if args.child in ARCHIVE else child)(args)
        return
    if args.mesh:
        args.only, args.nproc = ["mesh"], 4
    if not 0.25 <= args.size_gb <= (16 if args.device == "cuda" else 4):
        p.error("--size-gb: between 0.25 and 4 (16 with --device cuda)")
    args.dir = args.dir.resolve()
    if args.only is None:
        args.only = ["save", "load", "export"] + (["async"] if args.device == "cuda" else []) + ["resume"]
    import bench_mesh

    mesh_group = ("raw_write", "raw_write_mt", "raw_write_direct", *bench_mesh.SAVES, "raw_read", "raw_read_mt",
                  "raw_read_direct", *bench_mesh.LOADS)
    groups = {"save": SAVE, "load": LOAD, "export": EXPORT, "archive": ("ours_consolidate", *ARCHIVE), "async": ASYNC,
              "resume": (), "mesh": mesh_group}
    methods = [m for g in args.only for m in groups[g]]
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in methods]
        if unknown:
            p.error(f"--methods: {', '.join(unknown)} not among the methods of --only {' '.join(args.only)}: "
                    f"{', '.join(methods)}")
        methods = [m for m in methods if m in wanted]

    layers = layers_for(args.size_gb)
    model_bytes, nbytes = payload_bytes(layers)
    fresh(args.dir)
    (args.dir / "src").mkdir(parents=True)
    out = args.dir / "out"
    print(f"{nbytes / 1e9:.2f} GB of state ({model_bytes / 1e9:.2f} GB model, {layers} layers), "
          f"{args.nproc} rank(s), {args.reps} reps, in {args.dir}", flush=True)

    if not direct_io_supported(args.dir):
        print(f"{args.dir}: the filesystem refuses O_DIRECT; no device write/read reference", flush=True)
        methods = [m for m in methods if not m.endswith("_direct")]
    if args.baseline_tree:
        methods += [BASELINE + m for m in methods if m.startswith(("ours_save", "ours_load"))]
    # sources for the reads (the baseline tree's loads read the same ones)
    needed = {_source_of(m) for m in methods if m in LOAD}
    needed |= {bench_mesh.source_of(m) for m in methods if bench_mesh.source_of(m)}
    if "export" in args.only or "archive" in args.only:
        needed.add("ours_save_safetensors")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    failed: dict[str, str] = {}
    for method in sorted(needed):  # sources for the reads, written once (and timed: a timed method's first run)
        settle(out)
        r = _attempt(method, "source", args, layers, nbytes, failed)
        if r is None:
            continue
        if method in runs and not args.background_load:
            runs[method].append(r)
            print(f"  rep 1 {method}: {r['seconds']:.3f} s (kept as the loads' source)", flush=True)
        target = "raw" if method == "raw_write" else method
        out.rename(args.dir / "src" / target)
    if "archive" in args.only:
        make_archive_sources(args.dir / "src", layers)

    dropped = True
    busy = start_busy(args.background_load)
    load_before = os.getloadavg()
    load_after = load_before

    def summary() -> dict:
        result: dict = {
            "machine": machine(args.dir) | {"load_average_before": load_before, "load_average_after": load_after},
            "size_gb": nbytes / 1e9, "payload_bytes": nbytes, "model_bytes": model_bytes, "layers": layers,
            "nproc": args.nproc, "reps": args.reps, "device": args.device, "page_cache_dropped": dropped,
            "cpu_count": os.cpu_count(), "torch": _torch_version(), "background_load": args.background_load,
            "methods": {}, **({"failed": failed} if failed else {}),
        }
        for method, rs in runs.items():
            if not rs:
                continue
            size = model_bytes if method in EXPORT + ARCHIVE else nbytes
            result["methods"][method] = stats([r["seconds"] for r in rs], size) | {"extra_rss_mb": _max_rss(rs)}
            if "bytes_on_disk" in rs[0]:  # a save on a mesh: what it put on disk
                result.setdefault("bytes_on_disk", {})[method] = rs[0]["bytes_on_disk"]
            for extra, suffix in (("seconds_fsync", "+fsync"), ("seconds_total", "+total"), ("seconds_fence", "+fence"),
                                  ("seconds_step", "+step"), ("seconds_capture", "+capture")):
                if extra in rs[0]:
                    result["methods"][method + suffix] = stats([r[extra] for r in rs], size) | {
                        "extra_rss_mb": _max_rss(rs)}
        return result

    try:
        for rep in range(args.reps):
            turn = rep % max(1, len(methods))
            order = methods[turn:] + methods[:turn]
            for method in order:
                if method in failed or len(runs[method]) > rep or _source_of(method) in failed:
                    continue  # failed before, timed already (a source), or its source is missing
                reads = method.removeprefix(BASELINE) in LOAD + EXPORT + ARCHIVE + bench_mesh.LOADS
                dropped = settle(out, drop=reads) and dropped
                r = _attempt(method, f"rep {rep + 1}", args, layers, nbytes, failed)
                if r is None:
                    continue
                runs[method].append(r)
                print(f"  rep {rep + 1} {method}: {r['seconds']:.3f} s", flush=True)
                if args.json:  # what is measured so far, should the rest not finish
                    args.json.write_text(json.dumps(summary() | {"partial": True}, indent=2) + "\n")
            fresh(out)
        load_after = os.getloadavg()
    finally:
        stop_busy(busy)

    result = summary()
    if "resume" in args.only:  # launch to first step, resumed against fresh (tools/bench_resume.py)
        import bench_resume

        print("launch to first step:", flush=True)
        result["resume"] = bench_resume.measure(args.dir / "resume", llama_config(layers), args.nproc, args.reps,
                                                "safetensors", drop_caches)
    print_table(result)
    if "resume" in result:
        bench_resume.print_rows(result["resume"])
    for method, why in failed.items():
        print(f"\n{method}: {why.splitlines()[0]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    fresh(args.dir)


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep a CPU busy each (a Python loop) until ``stop_busy``."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def machine(folder: Path) -> dict:
    """What the numbers depend on: CPUs, memory, the filesystem of ``folder``, kernel, Python and torch."""
    import platform

    info: dict = {"cpu_count": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                if str(folder).startswith(mnt) and len(mnt) >= len(best):
                    best, info["filesystem"] = mnt, f"{fstype} on {dev} ({opts})"
    except OSError:
        pass
    return info


def _max_rss(runs: list[dict]) -> float | None:
    values = [r["extra_rss_mb"] for r in runs if r.get("extra_rss_mb") is not None]
    return max(values) if values else None


def _torch_version() -> str:
    import torch

    return torch.__version__


def print_table(res: dict) -> None:
    m = res["methods"]
    reads = "reads from storage (page cache dropped)" if res["page_cache_dropped"] else "reads from the page cache"
    mach = res.get("machine", {})
    print(f"\n{res['size_gb']:.2f} GB of model + AdamW state, {res['nproc']} rank(s), {res['device']}, "
          f"{res['reps']} interleaved reps; {reads}")
    print(f"{mach.get('cpu_count')} CPUs ({mach.get('cpu')}), {mach.get('memory_gib')} GiB, "
          f"{mach.get('filesystem')}, torch {res['torch']}; load average "
          f"{mach.get('load_average_before', [0])[0]:.1f} before, {mach.get('load_average_after', [0])[0]:.1f} after"
          + (f"; {res['background_load']} busy background processes" if res.get("background_load") else "") + "\n")
    print("| operation | method | median s | min s | max s | GB/s | vs raw | vs raw, same threads | vs peer "
          "| vs device | memory added MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sections = [
        ("save", ["raw_write", "raw_write_mt", "raw_write_direct", "torch_save", "torch_save+fsync", "dcp_save",
                  "ours_save_safetensors", "ours_save_torch_save"], "raw_write", "raw_write_mt", "dcp_save",
         "raw_write_direct"),
        ("load", ["raw_read", "raw_read_mt", "raw_read_direct", "raw_read_stream", "torch_load", "dcp_load",
                  "ours_load_safetensors", "ours_load_torch_save"],
         "raw_read", "raw_read_mt", "dcp_load", "raw_read_direct"),
        ("HF export", ["torch_consolidate", "torch_consolidate+fsync", "ours_consolidate"], None, None,
         "torch_consolidate+fsync", None),
        ("pack", ["ours_consolidate", "ours_pack"], None, None, "ours_consolidate", None),
        ("restore_from", ["restore_from_folder", "restore_from_archive"], "raw_read", "raw_read_mt",
         "restore_from_folder", "raw_read_direct"),
        ("async save", [f"ours_async_save_{f}{x}" for f in ("safetensors", "torch_save")
                        for x in ("", "+fence", "+step", "+capture", "+total")], "raw_write", "raw_write_mt",
         "ours_save_safetensors", "raw_write_direct"),
    ]

    def ratio(ref: str | None, r: dict) -> str:
        return f"{m[ref]['median_s'] / r['median_s']:.2f}×" if ref in m and r["median_s"] > 0 else "–"

    if any(name.startswith("mesh_") for name in m):
        import bench_mesh

        sections += bench_mesh.sections()
        LABELS.update(bench_mesh.labels())

    for op, names, raw, raw_mt, peer, device in sections:
        if not any(n in m for n in names if n != peer):  # only the reference ran (pack: the export, shown above)
            continue
        names = names + [BASELINE + n for n in names if n.startswith(("ours_save", "ours_load"))]
        for name in names:
            if name in m:
                r = m[name]
                label = LABELS[name.removeprefix(BASELINE)].replace("ours", "baseline tree", 1) \
                    if name.startswith(BASELINE) else LABELS[name]
                print(f"| {op} | {label} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} "
                      f"| {_gbs(r['gb_per_s'])} | {ratio(raw, r)} | {ratio(raw_mt, r)} | {ratio(peer, r)} "
                      f"| {ratio(device, r)} | {_mb(r['extra_rss_mb'])} |")
    for name, nbytes in (res.get("bytes_on_disk") or {}).items():
        print(f"{LABELS[name].strip('*')} put {nbytes / 1e9:.3f} GB on disk (model and optimizer files)")
    print("\nvs raw: raw's median time / this method's (1.00× = as fast as one plain sequential stream per rank; "
          "higher is faster); vs raw, same threads: the same against raw I/O with as many threads per rank as ours "
          "uses; vs peer: dcp.save / dcp.load / torch's + fsync (pack: the export; restore_from: the folder) "
          "median time over this method's; vs device: the "
          "O_DIRECT write / read of the same bytes (the page cache bypassed: what the device does) over this "
          "method's (save goal: >= 0.95×, load goal: >= 0.9×); on a mesh, vs peer: dp 4's time over this mesh's, and "
          "HSDP loads read each byte once per replica group; memory added: peak "
          "resident memory during the operation minus before it (rank 0, largest run).")


def _gbs(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    main()
