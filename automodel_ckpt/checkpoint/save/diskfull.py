"""A save or export that runs out of room (ENOSPC, EDQUOT, a read-only filesystem) as one line: folder, bytes needed, bytes free.

Failures reach the other ranks as text (``collective``), so a failure is recognised both by the ``errno`` of an
``OSError`` in the exception's chain (or in a DCP ``CheckpointException``'s per-rank failures) and by the
operating system's message for that errno in the text.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import torch

from automodel_ckpt.errors import DiskFullError
from automodel_ckpt.sizes import human_size

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])

_OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "the filesystem is read-only"}
_TEXTS = {os.strerror(code).lower(): code for code in _OUT_OF_ROOM}


def out_of_room(exc: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT or EROFS) behind ``exc``, or None when the failure is something else."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, tuple):
            todo.extend(item)
            continue
        if not isinstance(item, BaseException):
            continue
        if isinstance(item, DiskFullError):
            return item.errno
        if isinstance(item, OSError) and item.errno in _OUT_OF_ROOM:
            return item.errno
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend([item.__cause__, item.__context__])
        try:
            text = str(item).lower()
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails says nothing
            continue
        for words, code in _TEXTS.items():
            if words in text:
                return code
    return None


def tree_bytes(root: Path) -> int:
    """The bytes of the files below ``root`` (0 if it is gone)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def state_bytes(objects: Iterable[Any], *, local: bool = False) -> int:
    """The tensor bytes of models (their ``state_dict``) and optimizers (their ``state``), at their global size;
    with ``local``, only this rank's shards of sharded tensors."""
    total = 0
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            tensors: Iterable[Any] = obj.state_dict().values()
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = (v for s in obj.state.values() for v in s.values())
        else:
            continue
        if local:
            tensors = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem holding ``folder`` (or its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def message(code: int, what: str, folder: Path, needed: int | None, free: int | None, then: str) -> str:
    """``<what> in '<folder>' failed: <reason> (needs about N, M free there); <then>``, one line."""
    sizes = []
    if needed:
        sizes.append(f"needs about {human_size(needed)}")
    if free is not None:
        sizes.append(f"{human_size(free)} free there")
    detail = f" ({', '.join(sizes)})" if sizes else ""
    fix = ("remount it writable or choose another folder" if code == errno.EROFS
           else "free space (or raise the quota) or choose a folder on a larger filesystem")
    return f"{what} in '{folder}' failed: {_REASONS[code]}{detail}; {fix}; {then}"


def _raise_if_out_of_room(exc: BaseException, checkpoint_dir: Path, objects: Iterable[Any], rank: int) -> None:
    """Collective, after a save failed on every rank: if it ran out of room, remove its staging folder (rank 0)
    and raise the same one-line ``DiskFullError`` on every rank; otherwise return (the caller re-raises ``exc``).

    The bytes needed: the newest complete checkpoint's size on disk, or the state's tensor bytes if larger.
    """
    code = out_of_room(exc)
    if code is None or isinstance(exc, DiskFullError):  # None: another failure; DiskFullError: settled already
        return
    from automodel_ckpt.checkpoint.disk import catalog
    from automodel_ckpt.checkpoint import collective
    from automodel_ckpt.checkpoint.save import lifecycle

    def settle() -> str:
        newest = catalog.latest_checkpoint(checkpoint_dir)
        needed = max(tree_bytes(newest) if newest else 0, state_bytes(objects))
        removed = lifecycle.discard_staging(checkpoint_dir)
        logger.info("removed the unfinished checkpoint folder(s) %s", removed)
        then = (f"'{newest.name}' and the pointers are untouched and a rerun resumes from it" if newest
                else "no checkpoint was saved yet")
        return message(code, "saving a checkpoint", checkpoint_dir, needed, _free_bytes(checkpoint_dir), then)

    err = DiskFullError(collective.on_main(settle, "removing the unfinished checkpoint", rank))
    err.errno = code
    raise err from exc


def guarded(method: _F) -> _F:
    """A ``Checkpointer`` method whose failure, if it ran out of room, becomes ``_raise_if_out_of_room``'s error.

    Reads the checkpointer's ``dir``, ``env.rank`` and ``_saved_objects`` (the state of its last ``save``); does
    nothing where its ``settles_full_disk`` is False (the node-local tier abandons such a step itself).
    """
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if getattr(self, "settles_full_disk", True):
                _raise_if_out_of_room(exc, self.dir, getattr(self, "_saved_objects", []), self.env.rank)
            raise

    return wrapper  # type: ignore[return-value]


def export_error(exc: BaseException, out_dir: Path, needed: int | None) -> BaseException:
    """An export's failure: a one-line ``DiskFullError`` if it ran out of room, else ``exc`` unchanged."""
    code = out_of_room(exc)
    if code is None or isinstance(exc, DiskFullError):
        return exc
    err = DiskFullError(message(code, "writing the Hugging Face export", Path(out_dir).parent, needed,
                                _free_bytes(out_dir), f"its temporary folder was removed, '{out_dir}' is unchanged"))
    err.errno = code
    err.__cause__ = exc
    return err
