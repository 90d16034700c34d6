"""An export source folder's links: `export --to int8|gguf` and `pack` follow none out of the model's own files.

A Hugging Face folder given to `export` or `pack` is read only as ``paths.model_file_in`` allows: its regular files,
and, where it is a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``), its links that lead to a regular
file directly in that repository's real ``blobs/`` folder. Each case puts another link (to a process's environment,
to a file of the case's ``Outside``, to a FIFO there, through a blob that is itself a link, through a ``blobs/``
that is a link) in the folder, as the weights, the config or a tokenizer file, and runs the verbs that read it:
one ``error:`` line, a non-zero exit, nothing written, and nothing outside opened or copied in (inotify, the
marker). The control: a genuine cache snapshot exports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.harness import Outside, lean, refused, succeeded

EXPORT = "run/epoch_0_step_1/model/consolidated"
FIFO_TIMEOUT = 20


def _weights(folder: Path) -> str:
    return sorted(p.name for p in folder.glob("*.safetensors"))[0]


def link_to(rel: str, where):
    def tamper(folder: Path, outside: Outside) -> Path:
        name = _weights(folder) if rel == "WEIGHTS" else rel
        (folder / name).unlink()
        os.symlink(where(outside), folder / name)
        return folder
    return tamper


def _cache(folder: Path, blobs_elsewhere: Path | None = None) -> Path:
    """``folder``'s files as a Hugging Face cache snapshot beside it: every file a blob, every name a link to it
    (``blobs_elsewhere``: ``blobs/`` is then a link to that folder, the files moved there)."""
    repo = folder.parent / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    if blobs_elsewhere is None:
        blobs.mkdir()
    else:
        os.symlink(blobs_elsewhere, blobs)
    for k, f in enumerate(sorted(folder.iterdir())):
        if f.is_file() and not f.is_symlink():
            if blobs_elsewhere is None:
                shutil.copyfile(f, blobs / f"blob{k}")
                os.symlink(f"../../blobs/blob{k}", snapshot / f.name)
            else:
                os.symlink(f"../../blobs/inner.json", snapshot / f.name)  # what the outside folder holds
    return snapshot


def blob_linked_outside(folder: Path, outside: Outside) -> Path:
    snapshot = _cache(folder)
    blob = Path(os.path.realpath(snapshot / "tokenizer.json"))
    blob.unlink()
    os.symlink(outside.secret, blob)
    return snapshot


def blobs_folder_linked_outside(folder: Path, outside: Outside) -> Path:
    return _cache(folder, blobs_elsewhere=outside.dir)


CASES = {
    "tokenizer.json linked to /proc/self/environ": link_to("tokenizer.json", lambda o: "/proc/self/environ"),
    "tokenizer.json linked outside": link_to("tokenizer.json", lambda o: o.secret),
    "config.json linked outside": link_to("config.json", lambda o: o.secret),
    "the weights linked outside": link_to("WEIGHTS", lambda o: o.sentinel),
    "tokenizer_config.json linked to a FIFO outside": link_to("tokenizer_config.json", lambda o: o.pipe),
    "a cache blob that is a link outside": blob_linked_outside,
    "a cache whose blobs/ is a link outside": blobs_folder_linked_outside,
}
VERBS = {"int8": ["export", "--to", "int8", "--out", "out-int8", "--no-progress"],
         "gguf": ["export", "--to", "gguf", "--out", "out.gguf", "--no-progress"],
         "pack": ["pack", "--out", "out.tar"]}


@pytest.mark.parametrize("label", CASES)
def test_no_export_or_pack_follows_a_link_out_of_the_model(make_case, server, label):
    case = make_case()
    source = CASES[label](case.work / EXPORT, case.outside)
    for name, verb in VERBS.items():
        outcome = case.verb(verb[0], source, *verb[1:], timeout=FIFO_TIMEOUT)
        line = refused(outcome)
        assert "environ" not in label or "not a regular file" in line, f"{name}: {line}"
        lean(outcome, server.rss)
    for out in ("out-int8", "out.gguf", "out.tar"):
        assert not (case.work / out).exists(), out


def test_a_hugging_face_cache_snapshot_is_read_through_its_blobs(make_case):
    """The control: the same folder laid out as a cache snapshot exports and packs."""
    case = make_case()
    snapshot = _cache(case.work / EXPORT)
    for verb in VERBS.values():
        succeeded(case.verb(verb[0], snapshot, *verb[1:]))
    assert (case.work / "out-int8" / "tokenizer.json").is_file()
    assert not (case.work / "out-int8" / "tokenizer.json").is_symlink()
