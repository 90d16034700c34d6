"""Files sent between ranks over a gloo process group: point to point, in bounded chunks, checked on arrival.

A stream per (sender, receiver): header, chunks of at most ``_CHUNK_BYTES``, trailer. ``exchange`` posts one message
of every stream of a rank per round, and both ends post a stream's ``i``-th message in their ``i``-th round, so no
rank waits on one waiting for it and a rank holds one chunk per stream. A received name is untrusted: a plain
relative path only, written into a new file (``O_EXCL | O_NOFOLLOW``) renamed once its size and checksum are right;
every problem is one ``CheckpointError`` on both ends, at the end of the stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Generator, Mapping, Sequence

import torch
import torch.distributed as dist

from automodel_ckpt.ondisk import bounded, layout, paths
from automodel_ckpt.ondisk.checksum import CRC32, hasher
from automodel_ckpt.errors import CheckpointError, first_line

_CHUNK_BYTES = 64 << 20  # the most bytes of one file sent in one message
_MAX_HEADER_BYTES = 64 << 20  # a header (or trailer) longer than this is a broken stream
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC

# A stream is a generator of the tensors it sends or receives, one per round; it returns its problems.
_Stream = Generator[torch.Tensor, None, list[str]]


def exchange(outgoing: Mapping[int, Sequence[str]], src_root: Path, incoming: Mapping[int, Path], group: Any = None,
             *, expected: Mapping[str, Any] | None = None, chunk_bytes: int = _CHUNK_BYTES) -> dict[int, list[str]]:
    """Send ``outgoing[dst]`` (names below ``src_root``) to each global rank ``dst`` and receive from each ``src``
    into ``incoming[src]``; ``expected``: a manifest the received files must match. The names received per
    sender; ``CheckpointError`` on both ends, once every stream ended, for anything refused or failed."""
    me = dist.get_rank()
    if me in outgoing or me in incoming:
        raise ValueError(f"rank {me} cannot send files to itself")
    streams: dict[tuple[str, int], _Stream] = {}
    received: dict[int, list[str]] = {}
    for dst, rels in sorted(outgoing.items()):
        streams["send", dst] = send_stream(me, dst, list(rels), Path(src_root), chunk_bytes)
    for src, folder in sorted(incoming.items()):
        received[src] = []
        streams["recv", src] = receive_stream(src, Path(folder), expected, chunk_bytes, received[src])
    problems = _drive(streams, group)
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(f"node-local transfer failed: {'; '.join(problems[:3])}{more}")
    return received


def _drive(streams: dict[tuple[str, int], _Stream], group: Any) -> list[str]:
    """Run the streams round by round to their ends; their problems, in the order of the streams."""
    problems: dict[tuple[str, int], list[str]] = {}
    current: dict[tuple[str, int], torch.Tensor] = {}

    def advance(key: tuple[str, int]) -> None:
        try:
            current[key] = next(streams[key])
        except StopIteration as done:
            current.pop(key, None)
            problems[key] = done.value or []

    for key in streams:
        advance(key)
    while current:
        works = [(dist.isend if kind == "send" else dist.irecv)(tensor, peer, group=group)
                 for (kind, peer), tensor in current.items()]
        for work in works:
            work.wait()
        for key in list(current):
            advance(key)
    return [p for key in streams for p in problems.get(key, [])]


def _length(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64)


def _text(data: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(data).encode("utf-8")), dtype=torch.uint8)


# --- sending ------------------------------------------------------------------------------------------


def send_stream(me: int, dst: int, rels: list[str], root: Path, chunk_bytes: int = _CHUNK_BYTES) -> _Stream:
    """The messages rank ``me`` sends to ``dst``: the files ``rels`` below ``root``; returns its problems."""
    files: list[tuple[str, int, int]] = []  # (name, size, open descriptor)
    error = None
    try:
        for rel in rels:
            path = paths.path_inside(root, rel, f"the list of files for rank {dst}")
            fd = paths.open_regular(path)
            files.append((rel, os.fstat(fd).st_size, fd))
    except (OSError, CheckpointError) as exc:
        error = f"rank {me} could not send to rank {dst}: {first_line(exc)}"
        for _, _, fd in files:
            os.close(fd)
        files = []
    header = _text({"files": [[rel, size] for rel, size, _ in files], "error": error})
    yield _length(len(header))
    yield header
    problems = [error] if error else []
    buffer = torch.empty(min(chunk_bytes, max((size for _, size, _ in files), default=0)), dtype=torch.uint8)
    for rel, size, fd in files:
        with os.fdopen(fd, "rb", buffering=0) as f:
            for start in range(0, size, chunk_bytes):
                piece = buffer[:min(chunk_bytes, size - start)]
                filled = _read_into(f, piece)
                if filled < len(piece):
                    piece[filled:] = 0  # the receiver expects the header's size: it finds the problem in the trailer
                    problems.append(f"'{root / rel}' shrank while it was sent to rank {dst}")
                yield piece
    trailer = _text({"problems": problems})
    yield _length(len(trailer))
    yield trailer
    return problems


def _read_into(f: Any, piece: torch.Tensor) -> int:
    view, done = memoryview(piece.numpy()), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


# --- receiving ----------------------------------------------------------------------------------------


def receive_stream(src: int, folder: Path, expected: Mapping[str, Any] | None = None, chunk_bytes: int = _CHUNK_BYTES,
                   received: list[str] | None = None) -> _Stream:
    """Receive rank ``src``'s files below ``folder`` (names into ``received``), checked; its problems."""
    where = f"the header from rank {src} (into '{folder}')"
    header = yield from _receive_json(src)
    problems: list[str] = []
    files = header.get("files")
    if not isinstance(files, list) or not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                                              and bounded.is_count(f[1]) for f in files):
        raise CheckpointError(f"{where} is malformed (no list of names and sizes); the stream is broken")  # the stream cannot go on
    if isinstance(header.get("error"), str):
        problems.append(header["error"])
    listed = (expected or {}).get("files") or {}
    algorithm = str((expected or {}).get("checksum_algorithm", CRC32))
    buffer = torch.empty(min(chunk_bytes, max((size for _, size in files), default=0)), dtype=torch.uint8)
    seen: set[str] = set()
    for rel, size in files:
        sink = _Sink(folder, rel, size, listed.get(rel), algorithm, where, seen)
        for start in range(0, size, chunk_bytes):
            piece = buffer[:min(chunk_bytes, size - start)]
            yield piece
            sink.write(piece)
        if sink.finish() and received is not None:
            received.append(rel)
        elif sink.problem:
            problems.append(sink.problem)
    trailer = yield from _receive_json(src)
    problems += [p for p in trailer.get("problems", []) if isinstance(p, str) and p not in problems]
    return problems


def _receive_json(src: int) -> Generator[torch.Tensor, None, dict[str, Any]]:
    length = _length(0)
    yield length
    n = int(length.item())
    if not 0 <= n <= _MAX_HEADER_BYTES:
        raise CheckpointError(f"node-local transfer: rank {src} announced a message of {n} bytes "
                              f"(at most {_MAX_HEADER_BYTES}); the stream is broken")
    data = torch.empty(n, dtype=torch.uint8)
    yield data
    try:
        value = json.loads(data.numpy().tobytes().decode("utf-8"))
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise CheckpointError(f"node-local transfer: rank {src} sent a malformed message; the stream is broken")
    return value


class _Sink:
    """One received file: a new hidden file renamed into place once it checks out, or dropped (``problem``)."""

    def __init__(self, folder: Path, rel: str, size: int, entry: Any, algorithm: str, where: str,
                 seen: set[str]) -> None:
        self.rel, self.size, self.entry, self.where = rel, size, entry, where
        self.fd: int | None = None
        self.tmp: Path | None = None
        self.path: Path | None = None
        self.hash = None
        self.problem: str | None = None
        if rel in seen:
            self.problem = f"{where}: '{rel}' is sent twice"
            return
        seen.add(rel)
        if entry is not None and entry.get("size") != size:
            self.problem = f"{where}: '{rel}' is {size} bytes, its manifest says {entry.get('size')}"
            return
        try:
            self.path = paths.path_inside(folder, rel, where)
            _make_folders(folder, rel, where)
            self.tmp = self.path.parent / layout.received_tmp_name(self.path.name, secrets.token_hex(6))
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
            self.hash = hasher(algorithm) if entry is not None else None
        except (OSError, CheckpointError) as exc:
            self.problem = first_line(exc) if isinstance(exc, CheckpointError) else \
                f"{where}: cannot write '{rel}': {first_line(exc)}"
            self._drop()

    def write(self, piece: torch.Tensor) -> None:
        if self.fd is None:
            return
        view = memoryview(piece.numpy())
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self.problem = f"{self.where}: cannot write '{self.rel}': {first_line(exc)}"
            self._drop()
            return
        if self.hash is not None:
            self.hash.update(piece.numpy())

    def finish(self) -> bool:
        """Whether the file is in place: its size (and checksum, when listed) right."""
        if self.fd is None:
            return False
        written = os.fstat(self.fd).st_size
        if written != self.size:
            self.problem = f"{self.where}: '{self.rel}' arrived with {written} bytes, not {self.size}"
        elif self.hash is not None and self.hash.hexdigest() != self.entry.get("checksum"):
            self.problem = (f"{self.where}: '{self.rel}' does not match its manifest's checksum "
                            f"({self.entry.get('checksum')}, received {self.hash.hexdigest()})")
        if self.problem is None:
            os.close(self.fd)
            self.fd = None
            try:
                os.replace(self.tmp, self.path)  # type: ignore[arg-type]
                return True
            except OSError as exc:
                self.problem = f"{self.where}: cannot put '{self.rel}' in place: {first_line(exc)}"
        self._drop()
        return False

    def _drop(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


def _make_folders(root: Path, rel: str, where: str) -> None:
    """Create the folders to ``root / rel`` (mode 0700), refusing a symlink or file on the way."""
    folder = Path(root)
    if not os.path.lexists(folder):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for part in [None, *rel.split("/")[:-1]]:
        folder = folder if part is None else folder / part
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            mode = os.lstat(folder).st_mode
            if not stat.S_ISDIR(mode):
                raise CheckpointError(f"{where}: '{folder}' is {paths.file_kind(mode)}, not a folder; nothing is "
                                      "written through it") from None
