"""Generated (built-in) datasets kept as Arrow files in the Hugging Face datasets cache, named by what made them.

Made once from their arguments alone, then mapped by every rank and later start, their tokenization cached beside.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

#: Part of every file's name: change it when a generator's rows change for the same arguments.
GENERATED_VERSION = 1


def kept_on_disk(name: str, arguments: dict[str, Any], make: Callable[[], datasets.Dataset]) -> datasets.Dataset:
    """The dataset ``make()`` returns for ``arguments``, from its file in the cache (made and moved in on a miss)."""
    import datasets

    key = hashlib.sha256(json.dumps([GENERATED_VERSION, name, arguments], sort_keys=True, default=str)
                         .encode()).hexdigest()[:16]
    folder = Path(datasets.config.HF_DATASETS_CACHE) / "automodel_ckpt" / "generated"
    path = folder / f"{name}-{key}.arrow"
    if not path.is_file():
        made = make()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _quiet():
                made.flatten_indices(cache_file_name=str(path), new_fingerprint=key)
        except OSError as exc:  # a cache that cannot be written: the rows in memory, tokenized in memory each start
            logger.warning("cannot keep the %s dataset in %s (%s); it stays in memory", name, folder, exc)
            return made
    return datasets.Dataset.from_file(str(path))


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bar for writing the file (a start prints its own data line)."""
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    was = is_progress_bar_enabled()
    disable_progress_bar()
    try:
        yield
    finally:
        if was:
            enable_progress_bar()
