"""One run folder on an object store as the commit protocol uses it: listing, small objects, transfers, deletion."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from automodel_ckpt.ondisk import bounded, layout, paths
from automodel_ckpt.checkpoint.objectstore.location import normalize, open_filesystem, split
from automodel_ckpt.errors import CheckpointError, first_line

logger = logging.getLogger(__name__)

_BATCH = 8  # files (uploads) or ranges (downloads) transferred at once per process
RANGE = 32 * 2**20  # bytes of one ranged GET when downloading
_PARTS = 4  # parts of one large file (over 100 MiB: 50 MiB multipart parts) uploaded at once: memory is bounded by
# _BATCH * _PARTS * 50 MiB per process, whatever the size of the state


@dataclass
class ObjectStore:
    """``url`` (``s3://bucket/run``): checkpoints are prefixes below it; one exists once its commit object does."""

    url: str
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # credentials: never shown
    fs: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.url = normalize(self.url)
        self.scheme, self.root = split(self.url)
        if self.fs is None:
            self.fs = open_filesystem(self.url, self.storage_options)

    # --- names -------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join([self.root, *(p.strip("/") for p in parts if p)])

    def url_of(self, *parts: str) -> str:
        return f"{self.scheme}://{self.key(*parts)}"

    # --- checks ------------------------------------------------------------------------------------
    def access_problem(self, key: str, *, write: bool = True) -> str | None:
        """Whether the run folder can be listed (and ``write``: written): the problem in one line, or None."""
        bucket = self.root.split("/", 1)[0]
        probe = self.key(f".write-probe-{uuid.uuid4().hex[:12]}")
        try:
            self.fs.ls(self.root, refresh=True) if self.fs.exists(self.root) else self.fs.ls(bucket, refresh=True)
            if write:
                self.fs.pipe_file(probe, b"")
                self.fs.rm_file(probe)
        except FileNotFoundError:
            return (f"{key}: bucket '{bucket}' does not exist at {self._endpoint()}; create it or fix the URL "
                    f"'{self.url}'")
        except PermissionError as exc:
            return (f"{key}: access to '{self.url}' denied ({first_line(exc)}); check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY (or checkpoint.storage_options)")
        except Exception as exc:  # noqa: BLE001 - network errors come in many types
            text = first_line(exc)
            if "connect" in text.lower() or "endpoint" in text.lower() or isinstance(exc, (OSError, TimeoutError)):
                return (f"{key}: cannot reach the object store at {self._endpoint()} for '{self.url}' ({text}); "
                        "check AWS_ENDPOINT_URL and the network")
            return f"{key}: cannot use '{self.url}': {type(exc).__name__}: {text}"
        return None

    def _endpoint(self) -> str:
        client = getattr(self.fs, "client_kwargs", None) or {}
        return str(getattr(self.fs, "endpoint_url", None) or client.get("endpoint_url")
                   or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint")

    # --- listing -----------------------------------------------------------------------------------
    def prefixes(self) -> list[str]:
        """The prefixes directly below the run folder, the pieces' left out. A listing is untrusted: a name that is
        not one plain path component is logged and never used or deleted."""
        try:
            entries = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        names = plain_names(self.root, [e["name"] for e in entries if e.get("type") == "directory"])
        return [n for n in names if n != layout.PIECES_DIR]

    def committed(self, names: Iterable[str] | None = None) -> list[str]:
        """The checkpoints whose commit object exists (a prefix without one does not exist for any reader)."""
        names = self.prefixes() if names is None else list(names)
        return [n for n in names if self.exists(n, layout.MANIFEST_FILE)]

    def exists(self, *parts: str) -> bool:
        try:
            return bool(self.fs.exists(self.key(*parts)))
        except FileNotFoundError:
            return False

    def objects(self, name: str) -> list[dict[str, Any]]:
        """The objects below prefix ``name`` (folder placeholders, which some stores keep, left out)."""
        try:
            found = self.fs.find(self.key(name), detail=True)
        except FileNotFoundError:
            return []
        return [info for info in found.values() if info.get("type") != "directory"]

    def newest_write(self, name: str) -> float | None:
        """Seconds since the epoch of the newest object below prefix ``name`` (None when it holds none)."""
        stamps = [mtime_of(info) for info in self.objects(name)]
        return max((s for s in stamps if s is not None), default=None)

    # --- small objects -------------------------------------------------------------------------------
    def read_text(self, *parts: str, limit: int = bounded.SMALL_FILE_LIMIT) -> str | None:
        """A small object's text (None if absent); over ``limit`` bytes it is refused, never read whole."""
        try:
            data = self.fs.cat_file(self.key(*parts), start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        bounded.check_size(len(data), f"'{self.url_of(*parts)}'", "this object", limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"'{self.url_of(*parts)}' is not UTF-8 text") from None

    def cat_small(self, keys: list[str], limit: int) -> dict[str, bytes]:
        """``{key: bytes}`` of the objects of ``keys`` that exist, each refused when over ``limit`` bytes."""
        if not keys:
            return {}
        got = self.fs.cat_ranges(keys, [0] * len(keys), [limit + 1] * len(keys), on_error="return")
        out = {}
        for key, data in zip(keys, got):
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, BaseException):
                raise data
            bounded.check_size(len(data), f"'{self.scheme}://{key}'", "a catalog file", limit)
            out[key] = data
        return out

    def sizes(self, name: str) -> dict[str, int]:
        """``{relative path: size}`` of the objects below prefix ``name``, from one listing."""
        head = self.key(name).lstrip("/") + "/"
        return {key[len(head):]: int(info.get("size") or 0) for info in self.objects(name)
                if (key := str(info["name"]).lstrip("/")).startswith(head)}

    def write_text(self, text: str, *parts: str) -> None:
        self.fs.pipe_file(self.key(*parts), text.encode("utf-8"))

    def remove(self, *parts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(*parts))

    # --- bulk transfers ------------------------------------------------------------------------------
    def upload(self, local_root: Path, rels: list[str], name: str, keys: dict[str, str] | None = None) -> None:
        """Upload ``local_root/rel`` to ``name/rel`` (or ``keys[rel]``), many files at once, streamed from disk."""
        if not rels:
            return
        keys = keys or {}
        lpaths = [str(Path(local_root) / rel) for rel in rels]
        rpaths = [keys.get(rel) or self.key(name, rel) for rel in rels]
        self.fs.put(lpaths, rpaths, batch_size=_BATCH, max_concurrency=_PARTS)

    def download(self, name: str, rels: list[str], local_root: Path, sizes: dict[str, int] | None = None,
                 sources: dict[str, str] | None = None) -> None:
        """Fetch ``name/rel`` (or ``sources[rel]``) into ``local_root/rel`` in ranges of ``RANGE``, ``_BATCH`` GETs
        at once (memory below ``_BATCH * RANGE``); an object of another size than ``sizes`` is fetched as it is."""
        if not rels:
            return
        sizes, sources = dict(sizes or {}), sources or {}
        source = {rel: sources.get(rel) or self.key(name, rel) for rel in rels}
        for rel in rels:
            if rel not in sizes:
                sizes[rel] = int(self.fs.info(source[rel])["size"])
        tag = f".part-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        where, resolved = f"the listing of '{self.url_of(name)}'", {}
        targets = {rel: paths.path_inside(Path(local_root), rel, where, resolved) for rel in rels}  # untrusted names
        fds: dict[str, int] = {}
        try:
            for rel, target in targets.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                fds[rel] = os.open(str(target) + tag, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(fds[rel], sizes[rel])
            resized = {rel for rel in rels if sizes[rel] == 0}  # downloaded whole (an empty range is no request)
            ranges = [(rel, start, min(sizes[rel], start + RANGE))
                      for rel in rels for start in range(0, sizes[rel], RANGE)]

            def fetch_range(item: tuple[str, int, int]) -> None:
                rel, start, end = item
                last = end == sizes[rel]  # asks for one byte more: an object longer than listed shows too
                try:
                    data = self.fs.cat_file(source[rel], start=start, end=end + 1 if last else end)
                except Exception:  # noqa: BLE001 - a range past the end of a shorter object is refused
                    if int(self.fs.info(source[rel])["size"]) == sizes[rel]:
                        raise
                    data = b""
                if len(data) != end - start:
                    resized.add(rel)
                    return
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(fds[rel], view, start + len(data) - len(view)):]

            with ThreadPoolExecutor(max_workers=_BATCH, thread_name_prefix="download") as pool:
                futures = [pool.submit(fetch_range, item) for item in ranges]
                try:
                    for future in futures:
                        future.result()
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
            for rel, target in targets.items():
                os.close(fds.pop(rel))
                if rel in resized:
                    self.fs.get_file(source[rel], str(target) + tag)
                os.replace(str(target) + tag, target)
        finally:
            for rel, fd in fds.items():
                os.close(fd)
            for target in targets.values():
                if os.path.exists(str(target) + tag):
                    os.unlink(str(target) + tag)

    def delete_checkpoint(self, name: str) -> None:
        """Delete prefix ``name``: its commit object first, so a half-deleted checkpoint is never selectable."""
        self.remove(name, layout.MANIFEST_FILE)
        self.delete_prefix(name)

    def delete_prefix(self, name: str) -> None:
        """Delete prefix ``name``, its upload marker last (an interrupted delete leaves a leftover, still ours)."""
        marker = self.key(name, layout.UPLOAD_MARKER)
        rest = [info["name"] for info in self.objects(name) if info["name"].rstrip("/") != marker]
        if rest:
            self.fs.rm(rest)
        self.remove(name, layout.UPLOAD_MARKER)


def plain_names(parent: str, keys: Iterable[str]) -> list[str]:
    """The plain names below ``parent`` of the listed ``keys``, sorted; the others logged and dropped."""
    head = parent.strip("/") + "/"
    names = []
    for key in keys:
        key = str(key)
        bare = key.lstrip("/")  # some filesystems (memory://) list absolute names
        name = bare[len(head):] if bare.startswith(head) else None
        if name is not None and name.endswith("/"):
            name = name[:-1]
        if paths.is_plain_name(name):
            names.append(name)
        else:
            logger.warning("ignoring the prefix %r in '%s': not a plain name, never taken for a checkpoint", key,
                           parent)
    return sorted(names)


def mtime_of(info: dict[str, Any]) -> float | None:
    """When a listed object was last written (seconds since the epoch), or None where the listing does not say."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or info.get("updated")
    if stamp is None:
        return None
    if isinstance(stamp, (int, float)):
        return float(stamp)
    if hasattr(stamp, "timestamp"):
        return float(stamp.timestamp())
    try:
        from datetime import datetime

        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def wrap(what: str, fn: Any) -> Any:
    """Run a store operation; its failure as a one-line ``CheckpointError`` naming ``what``."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp raise many types
        raise CheckpointError(f"{what}: {type(exc).__name__}: {first_line(exc)}") from exc
