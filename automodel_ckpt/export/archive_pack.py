"""Writing one archive of a model: a checkpoint's export streamed into it, or an export or adapter folder's files.

Every member is laid out before a byte is written, so each is written straight to its place: a checkpoint's export
by the export's own writer (never staged on disk), files by ``copy_file_range``. A weights member's pax ``comment``
pads its data to a multiple of ``archive.ALIGN``. The manifest comes last, its own checksum in its extended header.
"""

from __future__ import annotations

import os
import secrets
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import yaml

from automodel_ckpt.ondisk import (SMALL_FILE_LIMIT, Archive, CheckpointFolder, HFFolder, build_manifest, check_path,
                                   default_algorithm, dump_manifest, exported_format, fsync_dir, hash_range, hasher,
                                   model_file_in, open_regular, parse_json, pread_full, pwrite_all, read_bytes,
                                   read_yaml, tmp_sibling)
from automodel_ckpt.export.archive import ADAPTER, ALIGN, CHECKPOINT, EXPORT, PAX_COMMENT
from automodel_ckpt.export.registry import export_targets, identify
from automodel_ckpt.export.plan import build_plan, parse_cast_dtype, progress_bar, resolve_model_dir
from automodel_ckpt.export.writer import OutFile, Write, kernel_copy, writes_into
from automodel_ckpt.errors import CheckpointError, UserError, first_line
from automodel_ckpt.redact import redacted


_WEIGHTS_SUFFIX = ".safetensors"
_COPY_CHUNK = 8 << 20
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Entry:
    """One member to write: its bytes come from ``data``, the regular file ``path`` or the export file ``out``."""

    name: str
    size: int
    data: bytes | None = None
    path: Path | None = None
    out: OutFile | None = None
    at: int = 0  # where its data starts in the archive, once laid out


def pack(src: Path, out: Path, *, cast_dtype: str | None = None, max_shard_size: int = 5 * 2**30,
         num_threads: int = 5, progress: bool = True) -> dict[str, Any]:
    """Write the archive of ``src`` (a checkpoint, an export or adapter folder) beside ``out``, then rename it into
    place; returns its manifest."""
    src, out = Path(src), Path(out)
    if out.is_dir():
        raise UserError(f"--out '{out}' is a folder; give the archive's file name (e.g. {src.name}{Archive.SUFFIX})")
    entries, source = _entries(src, parse_cast_dtype(cast_dtype), max_shard_size)
    tmp = tmp_sibling(out, secrets.token_hex(4))
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot write the archive '{out}': {exc.strerror or exc}") from None
    try:
        table = _write(fd, entries, source, num_threads, progress)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write the archive '{out}': {exc.strerror or first_line(exc)}") from None
        raise
    return table


def _write(fd: int, entries: list[Entry], source: dict[str, Any], num_threads: int,
           progress: bool) -> dict[str, Any]:
    headers, mtime, end = _lay_out(entries)
    with (progress_bar(sum(e.size for e in entries), progress, "packing") as advance,
          writes_into([(e.out, e.at) for e in entries if e.out is not None], fd, num_threads, advance)
          as (writes, run)):
        run(writes)
        for w in _member_writes(entries, headers, fd, advance):
            w.run()
    algorithm = default_algorithm()
    sums = {e.name: hash_range(fd, e.at, e.size, algorithm) for e in entries}
    table, tail = _manifest_tail(entries, sums, algorithm, source, mtime, end)
    pwrite_all(fd, tail, end)
    return table


def pack_into(src: Path, open_stream: Callable[[int], ContextManager[Any]], *, cast_dtype: str | None = None,
              max_shard_size: int = 5 * 2**30, num_threads: int = 5, progress: bool = True) -> dict[str, Any]:
    """Write the archive of ``src`` strictly forward into the stream ``open_stream(size)`` opens (``write`` and
    ``part_size``: an object store's upload); returns its manifest.

    A window of about ``part_size`` bytes at a time is written by the threads into an in-memory scratch file,
    hashed, handed to the stream while the next is produced, and dropped: nothing is written to disk, and a failure
    reaches the stream's block, which then commits nothing."""
    entries, source = _entries(Path(src), parse_cast_dtype(cast_dtype), max_shard_size)
    headers, mtime, end = _lay_out(entries)
    algorithm = default_algorithm()
    hashes = {e.name: hasher(algorithm) for e in entries}
    scratch = _scratch_file()
    try:
        with (open_stream(end) as stream, ThreadPoolExecutor(1, thread_name_prefix="upload") as sender,
              progress_bar(sum(e.size for e in entries), progress, "packing") as advance,
              writes_into([(e.out, e.at) for e in entries if e.out is not None], scratch, num_threads, advance)
              as (tensor_writes, run)):
            writes = sorted(tensor_writes + _member_writes(entries, headers, scratch, advance), key=lambda w: w.start)
            sending = None
            for lo, hi, batch in _windows(writes, stream.part_size, end):
                run(batch)
                window = bytearray(hi - lo)
                pread_full(scratch, memoryview(window), lo)  # never written (sparse) or past the end: zeros
                os.ftruncate(scratch, 0)  # its memory is given back; later windows lie past it
                view = memoryview(window)
                for e in entries:
                    first, last = max(e.at, lo), min(e.at + e.size, hi)
                    if first < last:
                        hashes[e.name].update(view[first - lo:last - lo])
                if sending is not None:
                    sending.result()
                sending = sender.submit(stream.write, window)
            if sending is not None:
                sending.result()
            table, tail = _manifest_tail(entries, {n: h.hexdigest() for n, h in hashes.items()}, algorithm, source,
                                         mtime, end)
            stream.write(tail)
    except OSError as exc:  # a member that cannot be read (the stream's own failures are one line already)
        raise CheckpointError(f"cannot pack '{src}': {first_line(exc)}; nothing was stored") from None
    finally:
        os.close(scratch)
    return table


def _lay_out(entries: list[Entry]) -> tuple[list[tuple[int, bytes]], int, int]:
    """Every member's header and where it starts, where its data starts (``Entry.at``), the members' mtime, and
    where the manifest's header goes."""
    mtime = int(time.time())
    pos, headers = 0, []
    aligned = (_WEIGHTS_SUFFIX, *(t.suffix for t in export_targets() if t.suffix))  # tensor data: weights, files
    for e in entries:
        header = _header(e.name, e.size, mtime, pos, align=e.name.endswith(aligned))
        headers.append((pos, header))
        e.at = pos + len(header)
        pos = e.at + e.size + (-e.size % tarfile.BLOCKSIZE)
    return headers, mtime, pos


def _manifest_tail(entries: list[Entry], sums: dict[str, str], algorithm: str, source: dict[str, Any], mtime: int,
                   at: int) -> tuple[dict[str, Any], bytes]:
    """The manifest and the archive's last bytes from ``at``: its header (its own checksum in it), the manifest,
    and the end-of-archive blocks (zeros, as tar writes them, up to a whole record)."""
    table = build_manifest(Path("."), {e.name: e.size for e in entries}, sums, algorithm)
    table = {**{k: v for k, v in table.items() if k != "files"}, "source": source, "files": table["files"]}
    data = dump_manifest(table).encode()
    digest = hasher(algorithm)
    digest.update(data)
    header = _header(Archive.MANIFEST, len(data), mtime, at, align=False,
                     pax={PAX_COMMENT: f"{algorithm}:{digest.hexdigest()}"})
    end = at + len(header) + len(data) + (-len(data) % tarfile.BLOCKSIZE) + 2 * tarfile.BLOCKSIZE
    end += -end % tarfile.RECORDSIZE
    return table, header + data + bytes(end - at - len(header) - len(data))


def _member_writes(entries: list[Entry], headers: list[tuple[int, bytes]], fd: int,
                   advance: Callable[[int], None]) -> list[Write]:
    """The writes of the tar headers, the small members and the files' chunks (not the export's)."""
    writes = [Write(at, len(h), lambda at=at, h=h: pwrite_all(fd, h, at)) for at, h in headers]
    for e in entries:
        if e.data is not None:
            writes.append(Write(e.at, e.size, lambda e=e: pwrite_all(fd, e.data, e.at)))
        elif e.path is not None:
            writes += [Write(e.at + first, min(_COPY_CHUNK, e.size - first),
                             lambda e=e, first=first: _copy_into(e.path, e.size, fd, e.at, advance, first))
                       for first in range(0, e.size, _COPY_CHUNK)]
    return writes


def _windows(writes: list[Write], part_size: int, end: int) -> Iterator[tuple[int, int, list[Write]]]:
    """``(lo, hi, writes)``: consecutive stretches ``[lo, hi)`` of the archive up to ``end``, each of at least
    ``part_size`` bytes (but the last) and the writes that fill it (sorted, none overlapping)."""
    lo = hi = 0
    batch: list[Write] = []
    for w in writes:
        if batch and hi - lo >= part_size:
            yield lo, hi, batch
            lo, batch = hi, []
        batch.append(w)
        hi = max(hi, w.start + w.size)
    yield lo, end, batch


def _scratch_file() -> int:
    """A file in memory (never on a disk: ``memfd``), or where that does not exist an unnamed temporary file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("ckpt-pack-window", os.MFD_CLOEXEC)
    import tempfile

    return os.dup(tempfile.TemporaryFile().fileno())


def _header(name: str, size: int, mtime: int, at: int, *, align: bool, pax: dict[str, str] | None = None) -> bytes:
    """The tar header of a member whose header starts at byte ``at``; with ``align``, padded so that its data
    starts at a multiple of ``ALIGN`` (every length here is a multiple of the 512-byte block, so widening the
    padding record by the gap closes it)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o644
    info.pax_headers = dict(pax or {})
    if not align:
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    width = 1
    while True:
        info.pax_headers = {PAX_COMMENT: "0" * width}
        buf = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        gap = -(at + len(buf)) % ALIGN
        if not gap:
            return buf
        width += gap


def _copy_into(src: Path, size: int, fd: int, at: int, advance: Callable[[int], None], first: int) -> None:
    """The chunk from byte ``first`` of the regular file ``src`` (never a link) of ``size`` bytes to ``fd`` from
    ``at + first``, in the kernel where the filesystems allow it."""
    end = min(size, first + _COPY_CHUNK)
    changed = f"'{src}' changed while it was packed; pack again"
    with os.fdopen(open_regular(src), "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != size:
            raise CheckpointError(changed)
        if kernel_copy(f.fileno(), fd, first, at + first, end - first, advance, changed):
            return
        done = first
        while done < end:
            chunk = os.pread(f.fileno(), min(_COPY_CHUNK, end - done), done)
            if not chunk:
                raise CheckpointError(changed)
            pwrite_all(fd, chunk, at + done)
            done += len(chunk)
            advance(len(chunk))


# --- what goes in ----------------------------------------------------------------------------------------------
def kind_of(src: Path) -> str:
    """``checkpoint``, ``export`` (a Hugging Face folder, an int8 export too), ``adapter`` or the name of the export
    target whose file ``src`` is (checked first: a damaged file is refused, not shipped)."""
    target = identify(src)
    if target is not None:
        target.check(src, "it is not packed")
        return target.name
    if not src.is_dir():
        nouns = " or ".join(t.noun for t in export_targets() if t.noun)
        raise UserError(f"'{src}' is not a folder or {nouns}; pack takes a checkpoint, an export folder, an adapter "
                        f"folder or {nouns}")
    if CheckpointFolder(src).metadata.is_file() or CheckpointFolder(src).model.is_dir():
        return CHECKPOINT
    if HFFolder(src).adapter_config.is_file():
        return ADAPTER
    if HFFolder(src).config.is_file():
        return EXPORT
    raise UserError(f"'{src}' is neither a checkpoint, a Hugging Face model folder (config.json) nor a PEFT "
                    "adapter folder (adapter_config.json)")


def _entries(src: Path, cast: Any, max_shard_size: int) -> tuple[list[Entry], dict[str, Any]]:
    """The members in archive order (the folder's files, its weights, this project's files) and the source."""
    kind = kind_of(src)
    source: dict[str, Any] = {"kind": kind, "name": src.resolve().name}
    if kind not in (CHECKPOINT, EXPORT, ADAPTER):  # one exported file
        return [Entry(src.name, os.stat(src).st_size, path=src)], source
    if kind != CHECKPOINT:
        return _folder_entries(src, with_ours=True), source
    source.update(kind=CHECKPOINT, checkpoint=src.name, run=src.resolve().parent.name)
    model_dir = resolve_model_dir(src)
    if HFFolder(model_dir).adapter_config.is_file():
        source["kind"] = ADAPTER
        entries = _folder_entries(model_dir, with_ours=False)
    else:
        exported_format(model_dir)
        plan = build_plan(model_dir, cast, max_shard_size)
        entries = [Entry(name, os.lstat(content).st_size, path=content) if isinstance(content, Path) else
                   Entry(name, len(content.encode()), data=content.encode()) for name, content in plan.side_files()]
        entries += [Entry(f.name, f.size, out=f) for f in plan.files]
    return _ordered(entries + _ours(src)), source


def _ours(checkpoint: Path) -> list[Entry]:
    """The checkpoint's recipe (redacted again: a received checkpoint's copy may hold what ours never writes) and
    its metadata."""
    out = []
    recipe, meta = CheckpointFolder(checkpoint).config, CheckpointFolder(checkpoint).metadata
    try:
        if os.path.lexists(recipe):
            text = yaml.safe_dump(redacted(read_yaml(recipe, "a checkpoint's recipe copy")), sort_keys=False)
            out.append(Entry(Archive.RECIPE, len(text.encode()), data=text.encode()))
        if os.path.lexists(meta):
            data = read_bytes(meta, "checkpoint metadata", SMALL_FILE_LIMIT)
            parse_json(data, f"'{meta}'", "checkpoint metadata", SMALL_FILE_LIMIT)
            out.append(Entry(Archive.METADATA, len(data), data=data))
    except OSError as exc:
        raise CheckpointError(f"cannot read '{checkpoint}': {first_line(exc)}") from None
    return out


def _folder_entries(folder: Path, *, with_ours: bool) -> list[Entry]:
    """The regular files of ``folder`` (and, ``with_ours``, of its ``automodel/``: an unpacked archive packs
    again); a cache snapshot's links are packed as their blobs, any other link or special file is refused."""
    entries = []
    for sub in ("", Archive.DIR) if with_ours else ("",):
        where = folder / sub if sub else folder
        if sub and (not os.path.isdir(where) or os.path.islink(where)):
            continue
        with os.scandir(where) as it:
            for entry in sorted(it, key=lambda e: e.name):
                name = f"{sub}/{entry.name}" if sub else entry.name
                if entry.is_dir(follow_symlinks=False) or name == Archive.MANIFEST:
                    continue
                real = model_file_in(where, entry.name, "an archive holds only regular files (and a cache "
                                        "snapshot's blobs), never what another link points to: replace it with the "
                                        "file itself")
                check_path(name, f"'{folder}'")
                entries.append(Entry(name, os.lstat(real).st_size, path=real))
    return _ordered(entries)


def _ordered(entries: list[Entry]) -> list[Entry]:
    """Small files first (a reader finds the config and index at the start), then the weights, then ours."""
    def rank(e: Entry) -> tuple[int, str]:
        ours = e.name.startswith(Archive.DIR + "/")
        return (2 if ours else 1 if e.name.endswith(_WEIGHTS_SUFFIX) else 0), e.name

    return sorted(entries, key=rank)


def pack_summary(table: dict[str, Any]) -> str:
    """``3 files, 1.2 GiB, xxh3_64``: what an archive's manifest lists."""
    from automodel_ckpt.sizes import human_size

    return (f"{len(table['files']) + 1} members, {human_size(table['total_bytes'])}, "
            f"{table['checksum_algorithm']} checksums")
