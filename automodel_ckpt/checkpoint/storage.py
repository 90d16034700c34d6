"""Durable filesystem steps: fsync of files and folders, atomic pointer swaps, pointer resolution."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from automodel_ckpt.checkpoint import layout


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new names, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on folders
    finally:
        os.close(fd)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def fsync_tree(root: Path, rank: int = 0, world_size: int = 1) -> None:
    """fsync this rank's share of the files below ``root``, then (rank 0) every folder, deepest first."""
    for i, path in enumerate(files_under(root)):
        if i % world_size == rank:
            fsync_file(path)
    if rank == 0:
        dirs = sorted((p for p in Path(root).rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, Path(root)]:
            fsync_dir(d)


def set_pointer(checkpoint_dir: Path, pointer: str, target_name: str) -> None:
    """Point ``checkpoint_dir/pointer`` at ``target_name``: a relative symlink swapped in by rename.

    ``rename`` over the old link is atomic, so a reader sees the old or the new target, never neither. Where
    symlinks are not supported, ``POINTER.txt`` holds the name instead (also replaced by rename).
    """
    checkpoint_dir = Path(checkpoint_dir)
    link = checkpoint_dir / pointer
    tmp = checkpoint_dir / f".{pointer}.tmp-{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target_name, tmp)
        os.replace(tmp, link)
        text = checkpoint_dir / layout.pointer_text_file(pointer)
        if text.exists():
            text.unlink()
    except OSError:
        if tmp.is_symlink():
            tmp.unlink()
        txt_tmp = checkpoint_dir / f".{pointer}.txt.tmp-{os.getpid()}"
        txt_tmp.write_text(target_name + "\n", encoding="utf-8")
        fsync_file(txt_tmp)
        os.replace(txt_tmp, checkpoint_dir / layout.pointer_text_file(pointer))
    fsync_dir(checkpoint_dir)


def read_pointer(checkpoint_dir: Path, pointer: str) -> str | None:
    """The name a pointer targets (symlink first, then the .txt fallback), or None when it has none."""
    link = Path(checkpoint_dir) / pointer
    if link.is_symlink():
        return Path(os.readlink(link)).name
    text = Path(checkpoint_dir) / layout.pointer_text_file(pointer)
    if text.exists():
        name = text.read_text(encoding="utf-8").strip()
        return name or None
    return None


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
