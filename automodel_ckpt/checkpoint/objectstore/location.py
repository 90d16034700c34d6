"""The fsspec filesystem that serves an object-store URL, and where its local mirror lives (syntax: ``locations``)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from automodel_ckpt.checkpoint.locations import local_path, normalize, split

def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The fsspec filesystem for ``url``; listings never cached (another process's commit must be seen at once)."""
    import fsspec

    for noisy in ("botocore", "aiobotocore", "s3fs"):  # "Found credentials in ..." on every client
        logging.getLogger(noisy).setLevel(logging.WARNING)
    scheme, _ = split(url)
    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    if scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
        # fail fast on a wrong endpoint instead of retrying for minutes
        options["config_kwargs"] = {"connect_timeout": 10, "retries": {"max_attempts": 3, "mode": "standard"}}
    options.update(storage_options or {})
    if scheme in ("s3", "s3a") and "session" not in options:
        options = _with_shared_models(options)
    return fsspec.filesystem(scheme, **options)


_LOADER: list[Any] = []  # this process's loader of botocore's service models (parsed once, then kept in it)


def _with_shared_models(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a new aiobotocore session (credentials resolved afresh, with the options s3fs would hand
    it) sharing the process's parsed service models: 0.12 s of CPU per filesystem opened before, 8 ms now."""
    import inspect

    import aiobotocore.session
    import s3fs

    named = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) | {"use_listings_cache", "max_paths",
                                                                             "listings_expiry_time", "skip_instance_cache"}
    session_kwargs = {k: v for k, v in options.items() if k not in named}  # e.g. profile
    session = aiobotocore.session.AioSession(**session_kwargs)
    _LOADER[:] = _LOADER or [session.get_component("data_loader")]
    session.register_component("data_loader", _LOADER[0])
    return {k: v for k, v in options.items() if k not in session_kwargs} | {"session": session}


def _cache_root() -> Path:
    """``$XDG_CACHE_HOME/automodel_ckpt`` (``~/.cache/automodel_ckpt``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "automodel_ckpt"


def mirror_folder(url: str, staging_dir: str | None, role: str = "run") -> Path:
    """The local folder a run (staging, cache) or a reading verb keeps for ``url``; ``staging_dir`` sets it."""
    if staging_dir:
        return local_path(staging_dir)
    url = normalize(url)
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[1])[-60:]
    digest = hashlib.sha1(url.encode()).hexdigest()[:10]
    return _cache_root() / "object-store" / role / f"{tag}-{digest}"
