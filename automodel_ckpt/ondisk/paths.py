"""Paths named by untrusted input (manifests, DCP metadata, index files, bucket listings): the one validator.

A path is used only if *plain* and reached without a symlinked folder on the way; only regular files are read, a
link only into a Hugging Face cache snapshot's ``blobs/``. The exact rules: docs/integrity.md (safe loading)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Iterator

from automodel_ckpt.errors import CheckpointError

_MAX_COMPONENT_BYTES = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")
_DRIVE = re.compile(r"^[A-Za-z]:")
_FSSPEC_SYNTAX = re.compile(r"[*?\[]|::")


def path_problem(rel: object) -> str | None:
    """Why ``rel`` is not a plain relative path of normal components (None when it is)."""
    if not isinstance(rel, str):
        return f"not a string but a {type(rel).__name__}"
    if not rel:
        return "empty"
    if _CONTROL.search(rel):
        return "a backslash or a control character"
    if rel.startswith("/"):
        return "absolute"
    if _DRIVE.match(rel):
        return "a drive"
    if _FSSPEC_SYNTAX.search(rel):
        return "a glob character or '::'"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"a '{part}' component" if part else "an empty component"
        if len(part.encode("utf-8", "surrogateescape")) > _MAX_COMPONENT_BYTES:
            return f"a component longer than {_MAX_COMPONENT_BYTES} bytes"
    return None


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one plain path component: what a checkpoint name (a bucket prefix) must be."""
    return isinstance(name, str) and "/" not in name and path_problem(name) is None


def check_path(rel: object, where: str) -> str:
    """``rel`` itself if plain; else a ``CheckpointError`` saying that ``where`` names an unsafe path."""
    why = path_problem(rel)
    if why is not None:
        raise CheckpointError(f"{where} names the unsafe path {rel!r} ({why}); only plain relative paths inside "
                              "the checkpoint are read or written")
    return rel  # type: ignore[return-value]


class UnsafePathError(CheckpointError):
    """A path that a folder reaches only through a link; ``reason`` says how, in a few words."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def path_inside(root: Path, rel: object, where: str, cache: dict[str, str] | None = None) -> Path:
    """``root / rel`` after ``check_path``; ``UnsafePathError`` when a folder on the way is a symlink or the path a
    symlink out of ``root``. The path need not exist. ``cache``: folders checked already below ``root``."""
    root = Path(root)
    path = root / check_path(rel, where)
    folder = root
    for part in rel.split("/")[:-1]:  # type: ignore[union-attr]
        folder = folder / part
        key = str(folder)
        if cache is not None and key in cache:
            continue
        try:
            mode = os.lstat(folder).st_mode
        except OSError:
            break  # nothing below a missing folder exists to be followed
        if stat.S_ISLNK(mode):
            _refuse_leading_out(root, folder, rel, where)
            shown = folder.relative_to(root).as_posix()
            raise UnsafePathError(f"{where} names the path {rel!r}, reached through the symlinked folder "
                                  f"'{shown}' in '{root}'; folders inside a checkpoint are never followed as links",
                                  f"reached through the symlinked folder '{shown}'")
        if cache is not None:
            cache[key] = key
    if os.path.islink(path):
        _refuse_leading_out(root, path, rel, where)
    return path


def _refuse_leading_out(root: Path, link: Path, rel: object, where: str) -> None:
    base = os.path.realpath(root).rstrip(os.sep) + os.sep
    if not os.path.realpath(link).startswith(base):
        raise UnsafePathError(f"{where} names the unsafe path {rel!r} (it leads out of '{root}' through a "
                              "symlink); only plain relative paths inside the checkpoint are read or written",
                              "leads out of the checkpoint through a symlink")


def walk_regular(root: Path, passed: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, int]]:
    """``(relative path, size)`` of the regular files below ``root``, sorted, no link followed; each link or special
    file goes to ``passed`` as ``(relative path, why)``."""
    for rel, st in regular_stats(root, passed):
        yield rel, st.st_size


def regular_stats(root: Path, passed: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """``walk_regular``'s files with their whole ``lstat`` (links, inode) taken once on the way."""
    for rel, st in _walk(Path(root), ""):
        why = not_regular(st.st_mode)
        if why is None:
            yield rel, st
        elif passed is not None and not stat.S_ISDIR(st.st_mode):
            passed.append((rel, why))


def folders_under(root: Path) -> list[str]:
    """The relative paths of the real folders below ``root`` (symlinked ones are not entered), sorted."""
    return [rel for rel, st in _walk(Path(root), "") if stat.S_ISDIR(st.st_mode)]


def _walk(folder: Path, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        rel = prefix + entry.name
        yield rel, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(Path(entry.path), rel + "/")


def open_regular(path: Path, *, follow: bool = False) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (a symlink only with ``follow``), else
    ``OSError`` (``FileNotFoundError`` when missing). A FIFO is opened without blocking and refused."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):  # ELOOP from O_NOFOLLOW
            raise OSError(exc.errno, "a symlink, not a regular file", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(f"'{path}' is a folder, not a regular file")
            raise OSError(f"'{path}' is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_text(path: Path, *, follow: bool = False) -> str:
    """The UTF-8 text of a small regular file of a checkpoint (through ``open_regular``)."""
    with os.fdopen(open_regular(Path(path), follow=follow), "rb") as f:
        return f.read().decode("utf-8")


def regular_file_problem(path: Path) -> str | None:
    """Why ``path`` (not followed if a symlink) is no regular file; None when it is one."""
    return not_regular(os.lstat(path).st_mode)


def not_regular(mode: int) -> str | None:
    """Why a file of ``mode`` (an ``lstat``'s) is no regular file; None when it is one."""
    return None if stat.S_ISREG(mode) else f"{file_kind(mode)}, not a regular file"


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (an ``lstat``'s) is, in words: "a symlink", "a FIFO", "a folder", ..."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "of an unknown kind"


def cache_blob(folder: Path, link: Path) -> Path | None:
    """The blob the symlink ``link`` of ``folder`` leads to, when ``folder`` is a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``) and the link ends at a regular file directly in the real ``<repo>/blobs/``;
    None for any other link."""
    snapshot = Path(os.path.realpath(folder))
    if snapshot.parent.name != "snapshots":
        return None
    blobs = snapshot.parent.parent / "blobs"
    target = Path(os.path.realpath(link))
    try:
        if not stat.S_ISDIR(os.lstat(blobs).st_mode) or target.parent != blobs:
            return None
        return target if stat.S_ISREG(os.lstat(target).st_mode) else None
    except OSError:
        return None


def model_file_in(folder: Path, name: str, refusal: str) -> Path:
    """The path to read for ``name`` of model folder ``folder``: itself when a regular file, its blob when a cache
    snapshot's link (``cache_blob``); anything else a one-line ``CheckpointError`` ending in ``refusal``."""
    path = Path(folder) / name
    mode = os.lstat(path).st_mode
    if stat.S_ISREG(mode):
        return path
    if stat.S_ISLNK(mode):
        blob = cache_blob(folder, path)
        if blob is not None:
            return blob
    raise CheckpointError(f"'{path}' is {file_kind(mode)}, not a regular file or a link into its Hugging Face cache "
                          f"repository's blobs/; {refusal}")
