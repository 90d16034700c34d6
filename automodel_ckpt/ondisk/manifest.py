"""``manifest.json``: the size and checksum of every file of a checkpoint, written last, just before publish.

The format: docs/integrity.md. Each rank hashes a share (fastio's from memory), rank 0 writes the manifest."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from automodel_ckpt.ondisk import bounded, layout, paths
from automodel_ckpt.ondisk.checksum import CRC32, default_algorithm, hash_file, hasher
from automodel_ckpt.ondisk.durable import WrittenFiles, fsync_dir, fsync_file, write_atomic
from automodel_ckpt.errors import CheckpointError, first_line

_MANIFEST_VERSION = 1

# verdicts of one file
OK = "ok"
SIZE_MISMATCH = "size mismatch"
CHECKSUM_MISMATCH = "checksum mismatch"
MISSING = "missing"
UNEXPECTED_FILE = "unexpected file"
UNREADABLE = "unreadable"


def list_files(root: Path) -> dict[str, int]:
    """``{relative path: size}`` of every regular file below ``root`` except the manifest, sorted by path."""
    return dict(sorted((rel, size) for rel, size in paths.walk_regular(root) if rel != layout.MANIFEST_FILE))


def writer_rank(rel: str) -> int | None:
    """The rank that wrote a per-rank file, when its name tells (its pages are in that rank's page cache)."""
    name = rel.rsplit("/", 1)[-1]
    parsed = layout.parse_model_shard_file(name)
    if parsed is not None:
        return parsed[0]
    parsed_rank = layout.parse_rank_state_file(name)
    if parsed_rank is not None:
        return parsed_rank[1]
    if name.startswith("__") and name.endswith(".distcp"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def assign(files: dict[str, int], world_size: int) -> list[list[str]]:
    """Split files across ranks: per-rank files to their writer, the rest greedily to the least-loaded rank."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for rel, size in files.items():
        r = writer_rank(rel)
        if r is not None and r < world_size:
            shares[r].append(rel)
            load[r] += size
        else:
            rest.append((size, rel))
    for size, rel in sorted(rest, key=lambda t: (-t[0], t[1])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        shares[r].append(rel)
        load[r] += size
    return shares


def build_manifest(root: Path, files: dict[str, int], checksums: dict[str, str], algorithm: str, *,
          linked: int = 0) -> dict[str, Any]:
    """The manifest of ``files``; ``linked``: bytes of them hard-linked (``linked_bytes``, when any)."""
    table: dict[str, Any] = {
        "manifest_version": _MANIFEST_VERSION,
        "layout_version": layout.LAYOUT_VERSION,
        "checksum_algorithm": algorithm,
        "total_bytes": sum(files.values()),
    }
    if linked:
        table["linked_bytes"] = linked
    table["files"] = {rel: {"size": files[rel], "checksum": checksums[rel]} for rel in sorted(files)}
    return table


def list_files_and_linked(root: Path) -> tuple[dict[str, int], int]:
    """``list_files(root)`` and the bytes of those files with more than one link (hard-linked), from one walk."""
    stats = [(rel, st) for rel, st in paths.regular_stats(root) if rel != layout.MANIFEST_FILE]
    return dict(sorted((rel, st.st_size) for rel, st in stats)), sum(st.st_size for _, st in stats if st.st_nlink > 1)


def dump_manifest(manifest: dict[str, Any]) -> str:
    """JSON with the header fields first and one line per file (readable, diffable)."""
    head = {k: v for k, v in manifest.items() if k != "files"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    files = [f"    {json.dumps(rel)}: {json.dumps(e, sort_keys=True)}" for rel, e in manifest.get("files", {}).items()]
    body = "{\n" + ",\n".join(files) + "\n  }" if files else "{}"
    return "{\n" + "\n".join(lines) + '\n  "files": ' + body + "\n}\n"


def write(root: Path, manifest: dict[str, Any]) -> Path:
    """Write and fsync ``manifest.json`` (and the folder entry naming it)."""
    file = Path(root) / layout.MANIFEST_FILE
    file.write_text(dump_manifest(manifest), encoding="utf-8")
    fsync_file(file)
    fsync_dir(Path(root))
    return file


def _hash_share(root: Path, rels: list[str], files: dict[str, int], algorithm: str,
                written: WrittenFiles | None) -> dict[str, str]:
    """Checksums of ``rels``: those ``written`` recorded for unchanged files, else hashed now (a few at once)."""
    out = {}
    todo = []
    for rel in rels:
        known = written.get(root / rel) if written is not None else None
        if known is not None and known.algorithm == algorithm and known.digest and os.path.getsize(root / rel) == files[rel]:
            out[rel] = known.digest
        else:
            todo.append(rel)

    def one(rel: str) -> tuple[str, str]:
        size, digest = hash_file(root / rel, algorithm)
        if size != files[rel]:
            raise CheckpointError(f"'{root / rel}' changed while the manifest was computed ({files[rel]} -> {size} "
                                  "bytes)")
        return rel, digest

    if todo:
        with ThreadPoolExecutor(min(4, len(todo)), thread_name_prefix="ckpt-hash") as pool:
            out.update(pool.map(one, todo))
    return out


def seal(staging: Path, rank: int, world_size: int, written: WrittenFiles | None = None, *,
         shared: bool = True) -> None:
    """Collective: every rank hashes its share of ``staging``'s files (using ``written``'s checksums), rank 0
    writes the manifest; a failure raises the same ``CheckpointError`` on every rank. ``shared`` False (node-local
    folders): each rank lists its own and each file is hashed by a rank that holds it."""
    from automodel_ckpt.distributed import collective
    from automodel_ckpt.distributed.env import gather_object, scatter_object

    staging = Path(staging)

    listed: dict[str, Any] = {}

    def plan() -> str:  # rank 0 lists the folder; each rank receives its own share of it only (scattered)
        listed["files"], listed["linked"] = list_files_and_linked(staging)
        listed["shares"] = assign(listed["files"], world_size)
        return default_algorithm()

    if shared:
        algorithm = collective.on_main(plan, f"listing the files of '{staging}'", rank)
        files = listed.get("files", {})
        share = scatter_object([{rel: files[rel] for rel in rels} for rels in listed["shares"]] if rank == 0 else None)
    else:
        algorithm, files, shares = _plan_apart(staging, rank, world_size)
        share = {rel: files[rel] for rel in shares[rank]}
    mine = collective.collectively(lambda: _hash_share(staging, list(share), share, algorithm, written),
                                   f"checksumming '{staging}'", rank)
    parts = gather_object(mine)  # rank 0 receives one share per rank; every other rank sends its own only
    if written is not None:
        written.forget(staging)
    collective.on_main(lambda: write(staging, build_manifest(staging, files, merge_checksums(parts or []), algorithm,
                                                             linked=listed.get("linked", 0))),
                       f"writing '{staging / layout.MANIFEST_FILE}'", rank)


def merge_checksums(parts: Iterable[dict[str, str]]) -> dict[str, str]:
    """Every rank's ``{relative path: checksum}`` as one mapping (rank 0, once per save: linear in the ranks)."""
    return {rel: digest for part in parts for rel, digest in part.items()}


def _plan_apart(staging: Path, rank: int, world_size: int) -> tuple[str, dict[str, int], list[list[str]]]:
    """Collective, folders not shared: every rank's listing gathered; each file hashed by its writer where that
    rank holds it, else by the least-loaded rank that holds it. A file of two sizes in two folders is refused."""
    from automodel_ckpt.distributed import collective
    from automodel_ckpt.distributed.env import all_gather_object

    listings = all_gather_object(collective.collectively(lambda: list_files(staging), f"listing '{staging}'", rank))
    files: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    for r, listing in enumerate(listings):
        for rel, size in listing.items():
            if files.setdefault(rel, size) != size:
                raise CheckpointError(f"'{staging.name}/{rel}' has {files[rel]} bytes on one node and {size} on "
                                      "another; the save is not complete")
            holders.setdefault(rel, []).append(r)
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for rel, size in sorted(files.items(), key=lambda t: (-t[1], t[0])):
        writer = writer_rank(rel)
        r = writer if writer in holders[rel] else min(holders[rel], key=lambda i: (load[i], i))
        shares[r].append(rel)
        load[r] += size
    return default_algorithm(), dict(sorted(files.items())), shares


def _find_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (one holding a manifest) that contains ``path``, if any."""
    return next((folder for folder in [Path(path), *Path(path).parents] if (folder / layout.MANIFEST_FILE).is_file()),
                None)


def add_files_to_manifest(folder: Path) -> bool:
    """Replace in its checkpoint's manifest the entries below ``folder`` by its files, written after the save (an
    offline export), by rename; False (nothing changed) outside a checkpoint with a manifest. One rank."""
    checkpoint = _find_checkpoint(folder)
    if checkpoint is None:
        return False
    current = read_manifest(checkpoint)
    if current is None:
        return False
    algorithm = str(current.get("checksum_algorithm", CRC32))
    prefix = Path(folder).relative_to(checkpoint).as_posix().rstrip("/") + "/"
    files = {rel: int(e["size"]) for rel, e in current["files"].items() if not rel.startswith(prefix)}
    checksums = {rel: str(e["checksum"]) for rel, e in current["files"].items() if not rel.startswith(prefix)}
    for rel in list_files(Path(folder)):
        size, digest = hash_file(Path(folder) / rel, algorithm)
        files[prefix + rel], checksums[prefix + rel] = size, digest
    updated = build_manifest(checkpoint, files, checksums, algorithm)
    updated["layout_version"] = current.get("layout_version", layout.LAYOUT_VERSION)
    write_atomic(checkpoint / layout.MANIFEST_FILE, dump_manifest(updated).encode("utf-8"))
    fsync_dir(checkpoint)
    return True


def read_manifest(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, None when it has none; ``CheckpointError`` when it is unreadable or malformed."""
    file = Path(checkpoint) / layout.MANIFEST_FILE
    if not file.exists():
        return None
    try:
        manifest = bounded.read_json(file, "a manifest", bounded.INDEX_FILE_LIMIT)
    except OSError as exc:
        raise CheckpointError(f"'{file}' is unreadable: {first_line(exc)}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and bounded.is_count(v.get("size"))
                                              and isinstance(v.get("checksum"), str) for v in files.values()):
        raise CheckpointError(f"'{file}' is malformed (no 'files' table of sizes and checksums)")
    for rel in files:  # untrusted: every listed path must stay inside the checkpoint
        paths.check_path(rel, f"'{file}'")
    return manifest


def _declared_version(file: Path) -> int | None:
    try:
        data = bounded.read_json(file, "checkpoint metadata", bounded.INDEX_FILE_LIMIT)
    except (OSError, CheckpointError):
        return None
    v = data.get("layout_version") if isinstance(data, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_layout_version(checkpoint: Path) -> None:
    """Refuse a checkpoint whose manifest or metadata declares a layout newer than this version understands."""
    checkpoint = Path(checkpoint)
    for name in (layout.MANIFEST_FILE, layout.METADATA_FILE):
        version = _declared_version(checkpoint / name)
        if version is not None and version > layout.LAYOUT_VERSION:
            raise CheckpointError(f"checkpoint '{checkpoint}' was written by a newer automodel-ckpt (layout {version} "
                                  f"> {layout.LAYOUT_VERSION}, {name}); upgrade automodel-ckpt to load it")


@dataclass
class Verdict:
    path: str
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    def describe(self) -> str:
        return f"{self.path}: {self.status}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ManifestReport:
    """The outcome of checking one checkpoint against its manifest."""

    checkpoint: Path
    verdicts: list[Verdict] = field(default_factory=list)
    problem: str | None = None  # a checkpoint-level problem: no manifest, unreadable manifest, newer layout
    algorithm: str | None = None
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None and all(v.ok for v in self.verdicts)

    @property
    def bad(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok]


def _check_file(root: Path, rel: str, entry: dict[str, Any], algorithm: str, checksums: bool,
               resolved: dict[str, str] | None = None) -> Verdict:
    """The verdict of one listed file: only a regular file inside ``root`` is looked at (no symlink out of it)."""
    try:
        path = paths.path_inside(Path(root), rel, "the manifest", resolved)
        st = os.lstat(path)
        not_regular, size = paths.not_regular(st.st_mode), st.st_size
    except CheckpointError as exc:
        return Verdict(rel, UNREADABLE, getattr(exc, "reason", first_line(exc)))
    except FileNotFoundError:
        return Verdict(rel, MISSING)
    except OSError as exc:
        return Verdict(rel, UNREADABLE, first_line(exc))
    if not_regular:
        return Verdict(rel, UNREADABLE, not_regular)
    return file_verdict(rel, entry, size, (lambda: hash_file(path, algorithm)[1]) if checksums else None, "on disk")


def file_verdict(rel: str, entry: dict[str, Any], size: int | None, digest: Callable[[], str] | None,
                 where: str) -> Verdict:
    """The verdict of listed file ``rel`` of ``size`` bytes (None: missing); ``where``: "on disk", "in the archive"."""
    if size is None:
        return Verdict(rel, MISSING)
    if size != entry["size"]:
        return Verdict(rel, SIZE_MISMATCH, f"manifest {entry['size']} bytes, {where} {size}")
    if digest is not None:
        try:
            found = digest()
        except OSError as exc:
            return Verdict(rel, UNREADABLE, first_line(exc))
        if found != entry["checksum"]:
            return Verdict(rel, CHECKSUM_MISMATCH, f"manifest {entry['checksum']}, {where} {found}")
    return Verdict(rel, OK)


def verify_manifest(checkpoint: Path, *, checksums: bool = True, only: Iterable[str] | None = None,
                    unexpected: bool = True, threads: int = 1) -> ManifestReport:
    """Check ``checkpoint``'s files against its manifest (``only``: just these); problems go in the report."""
    checkpoint = Path(checkpoint)
    report = ManifestReport(checkpoint)
    try:
        check_layout_version(checkpoint)
        manifest = read_manifest(checkpoint)
    except CheckpointError as exc:
        report.problem = str(exc)
        return report
    if manifest is None:
        report.problem = f"no {layout.MANIFEST_FILE} (written before manifests existed, or removed): cannot verify"
        return report
    algorithm = str(manifest.get("checksum_algorithm", CRC32))
    report.algorithm = algorithm
    report.total_bytes = int(manifest.get("total_bytes") or 0)
    listed: dict[str, dict[str, Any]] = manifest["files"]
    names = list(listed) if only is None else [rel for rel in only if rel in listed]
    try:
        if checksums:  # a size check needs no hasher (nor the import of its module: a cold one costs a load time)
            hasher(algorithm)
    except CheckpointError as exc:
        report.problem = str(exc)
        return report
    resolved: dict[str, str] = {}
    check: Callable[[str], Verdict] = lambda rel: _check_file(checkpoint, rel, listed[rel], algorithm, checksums,
                                                             resolved)
    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(threads) as pool:
            report.verdicts = list(pool.map(check, names))
    else:
        report.verdicts = [check(rel) for rel in names]
    if unexpected and only is None:
        report.verdicts += [Verdict(rel, UNEXPECTED_FILE, "not in the manifest") for rel in list_files(checkpoint)
                            if rel not in listed]
    report.verdicts.sort(key=lambda v: v.path)
    return report


def summarize(report: ManifestReport, limit: int = 3) -> str:
    """One line naming the first problems of a failed report."""
    if report.problem:
        return report.problem
    bad = report.bad
    text = "; ".join(v.describe() for v in bad[:limit])
    if len(bad) > limit:
        text += f"; and {len(bad) - limit} more"
    return text


def check_before_load(checkpoint: Path, *, checksums: bool, rank: int, world_size: int,
                      warn: Callable[[str], None] | None = None, leave: Callable[[str], bool] | None = None) -> None:
    """Raise ``CheckpointError`` if ``checkpoint`` is from a newer layout or its files do not match its manifest.
    On every rank: rank 0 checks each listed file's size, and with ``checksums`` each rank hashes its share except
    ``leave`` (the load hashes those). Unlisted files are ignored; no manifest: a warning."""
    checkpoint = Path(checkpoint)
    check_layout_version(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is None:
        if rank == 0 and warn is not None:
            warn(f"checkpoint '{checkpoint}' has no {layout.MANIFEST_FILE}; its files cannot be checked before loading")
        return
    listed = manifest["files"]
    reports = []
    if rank == 0:
        reports.append(verify_manifest(checkpoint, checksums=False, unexpected=False))
    if checksums:
        share = assign({rel: int(e["size"]) for rel, e in listed.items()}, world_size)[rank]
        share = [rel for rel in share if leave is None or not leave(rel)]
        reports.append(verify_manifest(checkpoint, checksums=True, only=share, unexpected=False))
    bad = [v for r in reports for v in r.bad]
    problem = next((r.problem for r in reports if r.problem), None)
    if problem or bad:
        seen = {v.path: v for v in reversed(bad)}  # the first verdict of each file
        merged = ManifestReport(checkpoint, sorted(seen.values(), key=lambda v: v.path), problem)
        raise CheckpointError(f"checkpoint '{checkpoint}' is damaged: {summarize(merged)} "
                              f"(`ckpt-train verify {checkpoint}` lists every file)")
