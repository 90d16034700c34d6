"""What a configured checkpoint location is: a local path or an object-store URL (syntax and installed backend, no I/O).

``check_url`` is the one check of a URL's shape (a known scheme with its backend, a valid bucket, plain key
components); ``check_location`` also refuses a path that reads as a URL with a slash missing (``s3:/bucket/run``).
"""

from __future__ import annotations

import re
from pathlib import Path

from automodel_ckpt.errors import ConfigError
from automodel_ckpt.ondisk import paths

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
_ALMOST_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/?(?!/)")
# An S3 bucket name as S3 clients accept one (botocore's check, which admits the older us-east-1 names too).
_S3_BUCKET = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
# fsspec schemes served by a package other than fsspec itself: what to install for each.
BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                    "abfss": "adlfs", "adl": "adlfs", "oci": "ocifs", "hf": "huggingface_hub",
                    "webdav": "webdav4", "dropbox": "dropboxdrivefs", "oss": "ossfs"}
# Schemes that are no object store a run could write to (or are local paths in disguise).
_NOT_STORES = {"http", "https", "zip", "tar", "memory", "reference", "cached", "simplecache", "filecache",
               "blockcache", "dir", "github", "git", "libarchive", "jlab", "jupyter", "data"}


def is_url(location: object) -> bool:
    """Whether a configured location is a URL (``s3://bucket/run``) rather than a local path."""
    m = _URL.match(str(location))
    return m is not None and m.group("scheme").lower() != "file"


def local_path(location: str) -> Path:
    """A local location as a path (``file://`` stripped)."""
    text = str(location)
    return Path(text[len("file://"):] if text.lower().startswith("file://") else text).expanduser()


def normalize(url: str) -> str:
    """``s3://bucket/run/`` -> ``s3://bucket/run`` (the scheme lower-cased, trailing slashes dropped)."""
    m = _URL.match(url.strip())
    if m is None:
        raise ValueError(url)
    return f"{m.group('scheme').lower()}://{m.group('rest').strip('/')}"


def split(url: str) -> tuple[str, str]:
    """``(scheme, bucket/prefix)`` of a normalized URL."""
    scheme, _, rest = normalize(url).partition("://")
    return scheme, rest


def check_location(location: object, key: str) -> None:
    """``ConfigError`` for a URL ``check_url`` refuses, or a path that reads as a URL missing a slash (``s3:/b``)."""
    text = str(location).strip()
    if is_url(text):
        check_url(text, key)
        return
    almost = _ALMOST_URL.match(text)
    if almost and almost.group("scheme").lower() in BACKEND_PACKAGES:
        scheme = almost.group("scheme").lower()
        raise ConfigError(f"{key}: '{text}' reads as a {scheme}:// URL with a slash missing; write it as "
                          f"{scheme}://BUCKET/PREFIX (or ./{text} for a local folder)")


def check_url(url: str, key: str, *, pattern: bool = False) -> None:
    """``ConfigError`` (one line) unless ``url`` names a store whose fsspec backend is installed, a bucket of a name
    it accepts and (unless ``pattern``: a glob of data files) a key prefix of plain path components. No I/O."""
    import fsspec
    from fsspec.registry import known_implementations

    scheme, rest = split(url)
    raw = _URL.match(url.strip())
    if not rest or (raw is not None and raw.group("rest").startswith("/")):
        raise ConfigError(f"{key}: '{url}' names no bucket; write it as {scheme}://BUCKET/PREFIX")
    if scheme in _NOT_STORES or (scheme not in known_implementations and scheme not in BACKEND_PACKAGES
                                 and scheme not in fsspec.available_protocols()):
        raise ConfigError(f"{key}: '{url}' has an unknown storage scheme '{scheme}://'; use a local path or an "
                          "object store URL such as s3://BUCKET/PREFIX, gs://... or az://...")
    bucket, _, prefix = rest.partition("/")
    why = paths.path_problem(bucket)
    if why is None and scheme in ("s3", "s3a") and not _S3_BUCKET.match(bucket):
        why = "only letters, digits, '.', '-' and '_'"
    if why is not None:
        raise ConfigError(f"{key}: '{url}' names the bucket {bucket!r}, which is no bucket name ({why})")
    why = None if pattern or not prefix else "an empty component" if prefix.startswith("/") else paths.path_problem(prefix)
    if why is not None:
        raise ConfigError(f"{key}: '{url}' names the key prefix {prefix!r} ({why}); write it as "
                          f"{scheme}://BUCKET/PREFIX, each part of PREFIX a plain name")
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        package = BACKEND_PACKAGES.get(scheme) or _package_from_fsspec(scheme) or f"the fsspec backend for {scheme}"
        raise ConfigError(f"{key}: '{url}' needs the {scheme}:// storage backend; install it with "
                          f"`pip install {package}`") from None


def _package_from_fsspec(scheme: str) -> str | None:
    from fsspec.registry import known_implementations

    err = str(known_implementations.get(scheme, {}).get("err", ""))
    m = re.search(r"[Ii]nstall\s+(?:the\s+)?['\"`]?([A-Za-z0-9_.\-]+)", err)
    return m.group(1) if m else None
