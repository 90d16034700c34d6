"""A model archive read in place: its members checked as untrusted input, their bytes, and the manifest check.

An archive (``ckpt-train pack``; docs/archive.md) is an uncompressed tar, never extracted: a member is a byte range
of the file, read with ``pread`` or mapped. ``open_archive`` refuses in one line a member whose name is not a plain
relative path, a link, a device, FIFO or sparse file, a name listed twice, bytes past the end of the file, extended
headers over 1 MiB, more than ``MAX_MEMBERS`` members, or a header that is not a tar header.
"""

from __future__ import annotations

import math
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import (CONFIG_FILE_LIMIT, INDEX_FILE_LIMIT, SMALL_FILE_LIMIT, UNEXPECTED_FILE, UNREADABLE,
                                   Archive, HFFolder, ManifestReport, Verdict, check_header, check_path, check_size,
                                   file_verdict, hash_range, header_length, open_regular, parse_header, parse_json,
                                   path_problem, tensor_entries)
from automodel_ckpt.errors import CheckpointError, first_line

ALIGN = 4096  # a weights member's data starts at a multiple of this in the archive: mapped in place, page-aligned
_BLOCK = tarfile.BLOCKSIZE
_MAX_EXTENDED_HEADER = SMALL_FILE_LIMIT  # a pax or GNU long-name record's size, checked before tarfile reads it
PAX_COMMENT = "comment"  # the pax keyword readers ignore: a weights member's padding; the manifest's own checksum
# what an archive's table records of the folder it was packed from; else the export target of its one file
CHECKPOINT, EXPORT, ADAPTER = "checkpoint", "export", "adapter"
MAX_MEMBERS = 1 << 16  # a model folder holds tens of files; each member costs memory while the archive is open
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)


def is_archive(path: Path) -> bool:
    """Whether ``path`` names an archive (a file, or a name ending in ``.tar``) rather than a folder."""
    path = Path(path)
    return not path.is_dir() and (path.name.endswith(Archive.SUFFIX) or path.exists())


@dataclass(frozen=True)
class Member:
    """One regular file of an archive: its name and where its bytes lie in the archive file."""

    name: str
    offset: int
    size: int
    checksum: str | None = None  # the manifest's own (``algorithm:hex``), from its extended header


class _BoundedTarInfo(tarfile.TarInfo):
    """``TarInfo`` that refuses an extended header record (pax, GNU long name) over the limit before reading it:
    tarfile itself reads such a record whole into memory, whatever size its header claims."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > _MAX_EXTENDED_HEADER:
            raise CheckpointError(f"an extended header of {self.size} bytes at byte {self.offset}, over the "
                                  f"{_MAX_EXTENDED_HEADER} byte limit")
        return super()._proc_member(tarfile_)


class OpenArchive:
    """An archive opened for reading: ``members`` by name, each checked to lie inside the file."""

    def __init__(self, path: Path, fd: int, members: dict[str, Member]) -> None:
        self.path, self.fd, self.members = Path(path), fd, members

    def __enter__(self) -> OpenArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def where(self, name: str) -> str:
        return f"'{name}' of the archive '{self.path}'"

    def member(self, name: str) -> Member:
        found = self.members.get(name)
        if found is None:
            raise CheckpointError(f"the archive '{self.path}' has no member '{name}'")
        return found

    def read(self, name: str, what: str, limit: int) -> bytes:
        """The bytes of member ``name`` (at most ``limit``: checked from its header before reading)."""
        m = self.member(name)
        check_size(m.size, self.where(name), what, limit)
        data = os.pread(self.fd, m.size, m.offset)
        if len(data) != m.size:
            raise CheckpointError(f"{self.where(name)} is cut short: the archive ends inside it")
        return data

    def json(self, name: str, what: str, limit: int = CONFIG_FILE_LIMIT) -> Any:
        return parse_json(self.read(name, what, limit), self.where(name), what, limit)

    def safetensors_header(self, name: str) -> tuple[dict[str, Any], int]:
        """``(header, data start in the member)`` of a safetensors member, checked as a file's would be."""
        m = self.member(name)
        where = self.where(name)
        n = header_length(os.pread(self.fd, 8, m.offset), m.size, where)
        header = parse_header(os.pread(self.fd, n, m.offset + 8), where)
        check_header(header, m.size - 8 - n, where)
        return header, 8 + n

    def manifest(self) -> dict[str, Any]:
        """The archive's manifest, its table checked (sizes, checksums, plain paths); ``CheckpointError`` else."""
        data = self.json(Archive.MANIFEST, "an archive manifest", INDEX_FILE_LIMIT)
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict) or not isinstance(data.get("checksum_algorithm"), str) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and not isinstance(v.get("size"), bool)
                and v["size"] >= 0 and isinstance(v.get("checksum"), str) for v in files.values()):
            raise CheckpointError(f"{self.where(Archive.MANIFEST)} is malformed (no 'files' table of sizes "
                                  "and checksums, or no 'checksum_algorithm')")
        for rel in files:
            check_path(rel, self.where(Archive.MANIFEST))
        return data


def open_archive(path: Path) -> OpenArchive:
    """The archive at ``path`` (a regular file), every member checked; else a one-line ``CheckpointError`` naming
    the archive and the member."""
    path = Path(path)
    try:
        fd = open_regular(path, follow=True)  # the file the user named (a cache's link to its blob)
    except FileNotFoundError:
        raise CheckpointError(f"the archive '{path}' does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"the archive '{path}' cannot be read: {first_line(exc)}") from None
    try:
        return OpenArchive(path, fd, _members(path, fd))
    except BaseException:
        os.close(fd)
        raise


def _members(path: Path, fd: int) -> dict[str, Member]:
    size = os.fstat(fd).st_size
    members: dict[str, Member] = {}

    def refuse(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"the archive '{path}' is refused: its member {name!r} {why}; an archive is read in "
                               "place, never extracted, and holds only regular files with plain relative names")

    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r:", tarinfo=_BoundedTarInfo)
            end = 0
            while (info := tar.next()) is not None:
                tar.members.clear()  # tarfile keeps every member it has read; ours are in ``members``
                if len(members) >= MAX_MEMBERS:
                    raise CheckpointError(f"the archive '{path}' is refused: it holds more than {MAX_MEMBERS} "
                                          "members, the limit for a model archive")
                name = _plain_name(info.name)
                if info.isdir():
                    if name and path_problem(name):
                        raise refuse(info.name, f"is a folder with an unsafe name ({path_problem(name)})")
                    end = info.offset_data
                    continue
                if info.issym() or info.islnk():
                    raise refuse(info.name, f"is a {'symbolic' if info.issym() else 'hard'} link to {info.linkname!r}")
                if not info.isreg() or info.issparse():
                    raise refuse(info.name, "is a device, FIFO, sparse file or other special member, not a regular "
                                            "file")
                why = path_problem(name)
                if why is not None:
                    raise refuse(info.name, f"has an unsafe name ({why})")
                if name in members:
                    raise refuse(info.name, "is listed twice")
                if info.offset_data + info.size > size:
                    raise refuse(info.name, f"runs to byte {info.offset_data + info.size}, past the end of the "
                                            f"{size}-byte file")
                own = info.pax_headers.get(PAX_COMMENT) if name == Archive.MANIFEST else None
                members[name] = Member(name, info.offset_data, info.size, own)
                end = info.offset_data + info.size
        except CheckpointError as exc:
            if str(exc).startswith(f"the archive '{path}'"):
                raise
            raise CheckpointError(f"the archive '{path}' is refused: {first_line(exc)}") from None
        except (tarfile.TarError, EOFError, ValueError, UnicodeError, OverflowError) as exc:
            raise CheckpointError(f"the archive '{path}' is not a readable tar file: {first_line(exc)}") from None
    _check_end(path, fd, end, size)
    return members


def _check_end(path: Path, fd: int, end: int, size: int) -> None:
    """tarfile stops quietly at a damaged header after the first; what follows the last member must be a header
    of zeros (the end of the archive) or nothing."""
    at = end + (-end % _BLOCK)
    block = os.pread(fd, _BLOCK, at)
    if block.strip(b"\0"):
        raise CheckpointError(f"the archive '{path}' is refused: byte {at} holds neither a member's header nor the "
                              "end of the archive")


def _plain_name(name: str) -> str:
    """A member name as ``tar cf x.tar -C folder .`` writes it (``./config.json``) is the same file."""
    while name.startswith("./"):
        name = name[2:]
    return "" if name == "." else name


# --- checks ----------------------------------------------------------------------------------------------------
def verify_archive(path: Path, *, checksums: bool = True) -> ManifestReport:
    """Every member against the archive's manifest (sizes; checksums unless ``checksums`` is False); an unreadable
    manifest is the report's ``problem``, an archive ``open_archive`` refuses a ``CheckpointError``."""
    report = ManifestReport(Path(path))
    with open_archive(path) as archive:
        try:
            own = archive.member(Archive.MANIFEST)
            algorithm, _, digest = (own.checksum or "").partition(":")
            if checksums and not digest:  # a plain tar drops the extended header that holds it
                report.verdicts.append(Verdict(own.name, UNREADABLE, "its header holds no "
                                               "checksum of it; pack the unpacked folder again"))
            else:
                report.verdicts.append(_check_member(archive, own.name, {"size": own.size, "checksum": digest},
                                                     algorithm, checksums))
            table = archive.manifest()
            report.algorithm = table["checksum_algorithm"]
            for rel, entry in table["files"].items():
                report.verdicts.append(_check_member(archive, rel, entry, report.algorithm, checksums))
                report.total_bytes += entry["size"]
            for rel in archive.members:
                if rel not in table["files"] and rel != Archive.MANIFEST:
                    report.verdicts.append(Verdict(rel, UNEXPECTED_FILE))
        except CheckpointError as exc:
            report.problem = first_line(exc)
    return report


def _check_member(archive: OpenArchive, rel: str, entry: dict[str, Any], algorithm: str, checksums: bool) -> Verdict:
    m = archive.members.get(rel)
    digest = (lambda: hash_range(archive.fd, m.offset, m.size, algorithm)) if checksums and m else None
    return file_verdict(rel, entry, m.size if m else None, digest, "in the archive")


def describe_archive(path: Path) -> dict[str, Any]:
    """What ``inspect`` shows of an archive: what it holds and where it came from, from its JSON members and
    safetensors headers."""
    with open_archive(path) as archive:
        table = archive.manifest()
        config = (archive.json(HFFolder.config, "a model config") if HFFolder.config in archive.members else
                  archive.json(HFFolder.adapter_config, "an adapter config", SMALL_FILE_LIMIT)
                  if HFFolder.adapter_config in archive.members else {})
        meta = (archive.json(Archive.METADATA, "checkpoint metadata", SMALL_FILE_LIMIT)
                if Archive.METADATA in archive.members else {})
        dtypes: dict[str, int] = {}
        for name in sorted(n for n in archive.members if n.endswith(".safetensors") and "/" not in n):
            header, _ = archive.safetensors_header(name)
            for entry in tensor_entries(header).values():
                dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + math.prod(entry["shape"])
        config = config if isinstance(config, dict) else {}
        meta = meta if isinstance(meta, dict) else {}
        source = table.get("source") if isinstance(table.get("source"), dict) else {}
        archs = config.get("architectures")
        kind = str(source.get("kind", ""))  # a folder's kind, else the export target whose one file it holds
        return {
            "archive": str(path),
            "holds": "adapter" if HFFolder.adapter_config in archive.members else
                     "model" if kind in (CHECKPOINT, EXPORT, ADAPTER, "") else "exported file",
            "source": kind,
            "model_type": str(config.get("model_type") or config.get("peft_type") or ""),
            "architecture": str(archs[0]) if isinstance(archs, list) and archs else "",
            "parameters": sum(dtypes.values()),
            "dtypes": dict(sorted(dtypes.items())),
            "run": str(source.get("run", "")),
            "checkpoint": str(meta.get("name") or source.get("checkpoint", "")),
            "step": meta.get("step") if isinstance(meta.get("step"), int) else None,
            "epoch": meta.get("epoch") if isinstance(meta.get("epoch"), int) else None,
            "files": len(archive.members),
            "bytes": sum(m.size for m in archive.members.values()),
        }
