"""The node-local folder of a run: where it is, private to its user, bound to one run, its room, its removal.

By default ``/dev/shm/automodel-ckpt-<user>/<run id>``, mode 0700, bound to its run by a file that refuses another
run's folder (docs/fast-recovery.md).
"""

from __future__ import annotations

import errno
import getpass
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from automodel_ckpt.ondisk import layout, paths
from automodel_ckpt.ondisk.durable import remove_tree, write_atomic
from automodel_ckpt.checkpoint.locations import is_url, local_path
from automodel_ckpt.errors import CheckpointError, first_line
from automodel_ckpt.sizes import human_size

_KEY = "checkpoint.local.dir"


def run_id(checkpoint_dir: str) -> str:
    """A short digest naming the run whose run folder is ``checkpoint_dir`` (a path, made absolute, or a URL)."""
    text = str(checkpoint_dir)
    location = text.rstrip("/") if is_url(text) else str(local_path(text).expanduser().resolve())
    return hashlib.sha256(location.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def default_folder(checkpoint_dir: str, base: Path = Path(layout.LOCAL_DEFAULT_BASE)) -> Path:
    """``/dev/shm/automodel-ckpt-<user>/<run id>``: the node-local folder when ``checkpoint.local.dir`` is unset."""
    return folder_of(run_id(checkpoint_dir), base)


def folder_of(run: str, base: Path = Path(layout.LOCAL_DEFAULT_BASE)) -> Path:
    """The default node-local folder of the run whose id is ``run``."""
    return Path(base) / layout.local_user_dir(_user()) / run


def _user() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container without a passwd entry)
        name = ""
    return name if paths.is_plain_name(name) else str(os.geteuid())


def claim(folder: Path, run: str, fingerprint: Any, *, private_parent: bool = False) -> list[str]:
    """Make ``folder`` private (mode 0700, with ``private_parent`` its parent too) and bind it to ``run`` and its
    ``fingerprint``; warnings to show, or ``CheckpointError`` when it cannot be used."""
    folder = Path(folder)
    if private_parent:
        _make_private(folder.parent)
    else:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{_KEY}: cannot create '{folder.parent}': {first_line(exc)}") from None
    _make_private(folder)
    return _bind(folder, run, fingerprint)


def _make_private(folder: Path) -> None:
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CheckpointError(f"{_KEY}: cannot create '{folder}': {first_line(exc)}; choose a writable folder on "
                              "each node") from None
    check_private(folder)


def check_private(folder: Path) -> None:
    """``CheckpointError`` unless ``folder`` is a real folder of this user's that no one else can use."""
    if os.path.islink(folder):
        raise CheckpointError(f"{_KEY}: '{folder}' is a symlink; a node-local folder is never reached through a "
                              "link: name the folder itself")
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        what = "not a folder" if exc.errno in (errno.ENOTDIR, errno.ELOOP) else first_line(exc)
        raise CheckpointError(f"{_KEY}: cannot use '{folder}': {what}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"{_KEY}: '{folder}' belongs to uid {st.st_uid}, not to this user (uid "
                              f"{os.geteuid()}); another user's folder is never used: choose your own")
    if st.st_mode & 0o066:
        raise CheckpointError(f"{_KEY}: '{folder}' can be read or written by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 700 '{folder}'` or choose a private "
                              "folder")


def fingerprint_digest(fingerprint: Any) -> str:
    """A digest of a run's fingerprint (``disk.fingerprint.run_fingerprint``'s, or any JSON-able value)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _bind(folder: Path, run: str, fingerprint: Any) -> list[str]:
    """Bind ``folder`` to the run ``run``: refused when another run's binding is there, or when it holds anything
    without one; the same run's steps written with another fingerprint are removed (a warning says so)."""
    folder = Path(folder)
    file = folder / layout.LOCAL_BINDING
    digest = fingerprint_digest(fingerprint)
    bound = read_binding(folder)
    warnings = []
    if bound is None:
        with os.scandir(folder) as it:
            found = sorted(e.name for e in it)
        if found:
            raise CheckpointError(f"{_KEY}: '{folder}' is not empty and holds no {layout.LOCAL_BINDING} (found "
                                  f"'{found[0]}'): it is not a node-local folder of a run; choose an empty or new "
                                  "folder")
    elif bound.get("run_id") != run:
        raise CheckpointError(f"{_KEY}: '{folder}' holds the node-local steps of another run (run id "
                              f"{bound.get('run_id')}, this run's is {run}: another checkpoint_dir); a folder is "
                              "never shared by two runs: choose another one or remove that one")
    elif bound.get("fingerprint") != digest:
        removed = _remove_steps(folder)
        warnings.append(f"{_KEY}: the recipe changed since '{folder}' was written (another run fingerprint): its "
                        f"{removed} node-local steps were removed")
    if bound is None or bound.get("fingerprint") != digest:
        write_atomic(file, (json.dumps({"run_id": run, "fingerprint": digest}) + "\n").encode("utf-8"), 0o600)
    return warnings


def read_binding(folder: Path) -> dict[str, Any] | None:
    """The run ``folder`` is bound to (id, fingerprint), None without a binding; ``CheckpointError`` if not ours."""
    file = Path(folder) / layout.LOCAL_BINDING
    if not os.path.lexists(file):
        return None
    try:
        data = json.loads(paths.read_text(file))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{_KEY}: '{file}' is unreadable ({first_line(exc)}); remove the folder '{folder}' "
                              "to start it afresh") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("run_id", "fingerprint")):
        raise CheckpointError(f"{_KEY}: '{file}' is malformed; remove the folder '{folder}' to start it afresh")
    return data


def _is_step_folder(name: str) -> bool:
    plain = name[len(layout.STAGING_PREFIX):] if layout.is_staging(name) else name
    return layout.parse_default_name(plain) is not None


def _remove_steps(folder: Path) -> int:
    """Remove the local steps (complete or being written) in ``folder``, following no link; how many."""
    with os.scandir(folder) as it:
        names = sorted(e.name for e in it if _is_step_folder(e.name))
    for name in names:
        remove_tree(Path(folder) / name)
    return len(names)


def check_space(folder: Path, step_bytes: int, keep: int, copies: int) -> None:
    """``CheckpointError`` with the numbers unless ``folder`` holds ``(keep + 1) * step_bytes * (1 + copies)``."""
    need = (keep + 1) * step_bytes * (1 + copies)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CheckpointError(
            f"{_KEY}: '{folder}' has {human_size(free)} free, but {keep + 1} node-local steps ({keep} kept and one "
            f"being written) of {human_size(step_bytes)} with {copies} copies each need {human_size(need)}; lower "
            "checkpoint.local.keep or checkpoint.local.replicas, or give the folder more room (a larger /dev/shm, "
            "or checkpoint.local.dir on local NVMe)")


def remove(folder: Path, run: str) -> bool:
    """Remove run ``run``'s finished node-local folder: only what this product wrote, following no link, then the
    folder if empty; nothing of a folder bound to no run or another. Whether it is gone."""
    folder = Path(folder)
    if os.path.islink(folder) or not folder.is_dir():
        return False
    try:
        bound = read_binding(folder)
    except CheckpointError:
        return False
    if bound is None or bound.get("run_id") != run:
        return False
    _remove_steps(folder)
    os.unlink(folder / layout.LOCAL_BINDING)
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True
