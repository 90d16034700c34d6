"""A save that runs out of room settled on every rank: its staging folder removed, one line saying what it needs.

What counts as out of room and the line itself are the checkpoint folder's (``ondisk.outofroom``); this module
adds what a save knows: the state's size, the newest checkpoint, the collective that settles it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import torch

from automodel_ckpt.errors import DiskFullError
from automodel_ckpt.ondisk.outofroom import free_bytes, message, out_of_room, tree_bytes

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])


def state_bytes(objects: Iterable[Any], *, local: bool = False) -> int:
    """The tensor bytes of models and optimizers at their global size; with ``local``, this rank's shards."""
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


def _raise_if_out_of_room(exc: BaseException, checkpoint_dir: Path, objects: Iterable[Any], rank: int) -> None:
    """Collective, after a save failed: if out of room, rank 0 removes the staging folder and every rank raises
    one ``DiskFullError`` naming the bytes needed (the newest checkpoint's or the state's, the larger)."""
    code = out_of_room(exc)
    if code is None or isinstance(exc, DiskFullError):  # None: another failure; DiskFullError: settled already
        return
    from automodel_ckpt.ondisk import catalog
    from automodel_ckpt.distributed import collective
    from automodel_ckpt.checkpoint.storage import lifecycle

    def settle() -> str:
        newest = catalog.latest_checkpoint(checkpoint_dir)
        needed = max(tree_bytes(newest) if newest else 0, state_bytes(objects))
        removed = lifecycle.discard_staging(checkpoint_dir)
        logger.info("removed the unfinished checkpoint folder(s) %s", removed)
        then = (f"'{newest.name}' and the pointers are untouched and a rerun resumes from it" if newest
                else "no checkpoint was saved yet")
        return message(code, "saving a checkpoint", checkpoint_dir, needed, free_bytes(checkpoint_dir), then)

    err = DiskFullError(collective.on_main(settle, "removing the unfinished checkpoint", rank))
    err.errno = code
    raise err from exc


def guarded(method: _F) -> _F:
    """A writer method whose out-of-room failure is settled on every rank, unless ``settles_full_disk`` is False."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if getattr(self, "settles_full_disk", True):
                _raise_if_out_of_room(exc, self.dir, getattr(self, "_saved_objects", []), self.env.rank)
            raise

    return wrapper  # type: ignore[return-value]
