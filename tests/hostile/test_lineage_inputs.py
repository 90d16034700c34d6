"""Lineage read from files is data: a parent outside the folder named is printed and only looked up as a regular
folder (never through a link), a record over 1 MiB is refused in one line (metadata, export folder file, GGUF key),
and escape codes in a name are printed escaped, each parent on one line. A parent that is no checkpoint, export,
GGUF file or archive (a /proc, /dev or /sys path, a FIFO, a socket, a plain folder or file) is named, never opened;
a cycle is found however its paths are spelled; each folder is fingerprinted once and the listing is capped. No
training: records written by hand; the listings that could hang run in the corpus's child processes, timed out."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from automodel_ckpt.cli import main
from automodel_ckpt.ondisk import layout
from tests.hostile.harness import Outside, succeeded

LINEAGE_FILE = layout.LINEAGE_FILE
MiB = 2**20
TIMEOUT = 20  # a listing takes a second; one that walks a cycle or hashes a manifest per line is killed then


def _checkpoint(folder: Path, parents: list[dict], pad: int = 0) -> Path:
    folder.mkdir(parents=True)
    meta = {"step": 1, "epoch": 0, "lineage": {"parents": parents}, "pad": "x" * pad}
    (folder / layout.METADATA_FILE).write_text(json.dumps(meta))
    return folder


def _inspect(capsys, target: Path) -> tuple[int, str, str]:
    code = main(["inspect", str(target), "--lineage"])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_a_parent_outside_the_folder_is_printed_and_only_read_as_a_regular_folder(capsys, tmp_path):
    outside = _checkpoint(tmp_path / "elsewhere" / "secret", [{"role": "base model", "path": "/the/root/model",
                                                               "fingerprint": "sha256:00"}])
    (tmp_path / "run").mkdir()
    linked = tmp_path / "run" / "linked"
    linked.symlink_to(outside, target_is_directory=True)
    mine = _checkpoint(tmp_path / "run" / "ck", [
        {"role": "restored from", "path": str(outside), "fingerprint": "sha256:11"},
        {"role": "resumed from", "path": str(linked), "fingerprint": "sha256:22"},
        {"role": "base model", "path": "/etc", "fingerprint": "sha256:33"}])
    code, out, err = _inspect(capsys, mine)
    assert code == 0, err
    lines = out.splitlines()
    assert any(line.strip() == f"restored from: {outside} (sha256:11) [changed: now " + line.split("now ")[-1]
               for line in lines), out
    assert "    base model: /the/root/model (sha256:00) [gone]" in lines  # a regular folder: its record read
    assert f"  resumed from: {linked} (sha256:22) [a link: not followed]" in lines
    assert sum("/the/root/model" in line for line in lines) == 1  # not read again through the link
    assert "  base model: /etc (sha256:33) [a folder that is no checkpoint or export: not read]" in lines


def test_a_10_mb_lineage_record_is_refused_in_one_line(capsys, tmp_path):
    big = _checkpoint(tmp_path / "ck", [], pad=10 * 1024 * 1024)
    code, _, err = _inspect(capsys, big)
    assert code != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "10.0 MiB, over the 1.0 MiB limit for a lineage record" in err
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / LINEAGE_FILE).write_text(json.dumps({"parents": [], "pad": "x" * (10 * 1024 * 1024)}))
    code, _, err = _inspect(capsys, folder)
    assert code != 0 and len(err.splitlines()) == 1 and "over the 1.0 MiB limit for a lineage record" in err


def test_a_10_mb_gguf_lineage_key_is_refused_in_one_line(capsys, tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("automodel_ckpt.lineage", json.dumps({"parents": [], "pad": "x" * (10 * 1024 * 1024)}))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    code, _, err = _inspect(capsys, path)
    assert code != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "its automodel_ckpt.lineage is 1048" in err and "over the limit of 1048576 for a lineage record" in err


def test_escape_codes_and_newlines_in_names_are_printed_escaped(capsys, tmp_path):
    hostile = "/x\x1b]0;owned\x07\n  base model: /forged (sha256:ff) [present]\u202e"
    mine = _checkpoint(tmp_path / "ck", [{"role": "base\x1b[2J model", "path": hostile, "fingerprint": "sha\r256"}])
    code, out, err = _inspect(capsys, mine)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert len(lines) == 2 and "\\x1b]0;owned\\x07\\n  base model: /forged" in lines[1], out


def test_a_cycle_is_printed_once(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _checkpoint(a, [{"role": "resumed from", "path": str(b)}])
    _checkpoint(b, [{"role": "resumed from", "path": str(a)}])
    code, out, err = _inspect(capsys, a)
    assert code == 0, err
    assert "(its own ancestor: a cycle, not followed)" in out and len(out.splitlines()) < 8


def test_a_shared_ancestor_is_no_cycle_and_its_parents_are_listed_once(capsys, tmp_path):
    """A run restored from an SFT run names the same base model as that run did: a diamond, not a cycle. A parent
    with parents of its own met twice lists them once; one without any is just named again."""
    base = _checkpoint(tmp_path / "base", [{"role": "converted from", "path": "/the/hub/model"}])
    sft = _checkpoint(tmp_path / "sft", [{"role": "base model", "path": str(base)}])
    grpo = _checkpoint(tmp_path / "grpo", [{"role": "base model", "path": str(base)},
                                           {"role": "restored from", "path": str(sft)}])
    code, out, err = _inspect(capsys, grpo)
    assert code == 0, err
    assert "cycle" not in out, out
    assert out.count("converted from: /the/hub/model") == 1, out
    assert out.count(f"base model: {base}") == 2 and out.count("(its parents are listed above)") == 1, out


def _listing(server, target: Path, cwd: Path) -> list[str]:
    """``inspect TARGET --lineage`` in a child process (killed after ``TIMEOUT``): its lines, after a clean exit 0."""
    outcome = server.run(["inspect", str(target), "--lineage"], cwd=cwd, timeout=TIMEOUT)
    succeeded(outcome)
    return outcome.stdout.splitlines()


def _manifest(checkpoint: Path, size: int) -> None:
    """A manifest of ``size`` bytes, sparse (read and hashed as zeros, no disk): what a fingerprint reads."""
    with open(checkpoint / layout.MANIFEST_FILE, "wb") as f:
        f.truncate(size)


def test_a_checkpoint_naming_itself_however_spelled_is_one_cycle(server, tmp_path):
    """``DIR/.``, ``DIR/./.``, ..., ``../run/DIR``, ``//``, a trailing slash: one folder, so each is a cycle at
    once; the 16 MiB manifest is hashed once, not once per line (which never finished)."""
    run = tmp_path / "run"
    ck = run / "ck"
    spellings = [str(ck) + "/." * n for n in range(1, 248)]
    spellings += [str(run / ".." / "run" / "ck"), f"{tmp_path}//run/ck", "../run/ck", "ck/", "./ck/./", str(ck),
                  f"{ck}/../ck"]
    alias = tmp_path / "alias"
    spellings.append(str(alias))
    _checkpoint(ck, [{"role": "resumed from", "path": p, "fingerprint": "sha256:00"} for p in spellings])
    _manifest(ck, 16 * MiB)
    alias.symlink_to(ck, target_is_directory=True)
    lines = _listing(server, ck, run)
    entries = [line for line in lines if line.startswith("  resumed from: ")]
    assert len(entries) == len(spellings), lines[:5]
    assert lines.count("    (its own ancestor: a cycle, not followed)") == len(spellings) - 1, lines[:8]
    assert entries[-1].endswith("[a link: not followed]")
    assert not any(line.startswith("    resumed from") for line in lines)  # nothing listed below a cycle
    assert len(lines) == 1 + 2 * len(spellings) - 1


def test_two_checkpoints_naming_each_other_by_other_spellings_are_a_cycle(server, tmp_path):
    a, b = tmp_path / "run" / "a", tmp_path / "run" / "b"
    _checkpoint(a, [{"role": "resumed from", "path": f"{b}/./"}])
    _checkpoint(b, [{"role": "resumed from", "path": str(tmp_path / "run" / ".." / "run" / "a")}])
    lines = _listing(server, a, tmp_path)
    assert lines[1:] == [f"  resumed from: {b}/./ (no fingerprint) [present]",
                         f"    resumed from: {tmp_path}/run/../run/a (no fingerprint) [present]",
                         "      (its own ancestor: a cycle, not followed)"], lines


def test_parents_that_are_no_checkpoint_export_gguf_or_archive_are_named_not_read(server, tmp_path):
    """/proc, /dev and /sys paths, FIFOs, a socket, links to them, a plain folder or file: each named with what it
    is, none opened (``Outside`` watches its own), nothing listed below any of them."""
    outside = Outside(tmp_path / "outside")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    links = {tmp_path / "to_environ": "/proc/self/environ", tmp_path / "to_zero": "/dev/zero",
             tmp_path / "to_pipe": outside.pipe, tmp_path / "to_dir": outside.dir}
    for link, target in links.items():
        link.symlink_to(target)
    kernel, device, fifo_, folder = ("on a filesystem of the kernel's", "a character device, not a folder or file",
                                     "a FIFO, not a folder or file", "a folder that is no checkpoint or export")
    parents = {"/proc/self/environ": kernel, "/proc/self/status": kernel, "/proc/self/": kernel, "/proc/1/": kernel,
               "/sys": kernel, "/dev/": kernel, "/dev/zero": device, "/dev/null": device, "/dev/urandom": device,
               str(fifo): fifo_, str(outside.pipe): fifo_, str(tmp_path / "sock"): "a socket, not a folder or file",
               **{str(link): "a link: not followed" for link in links},
               str(outside.dir): folder, str(outside.root): folder, "/etc": folder,
               str(outside.secret): "a file that is no GGUF file", "/etc/passwd": "a file that is no GGUF file"}
    ck = _checkpoint(tmp_path / "ck", [{"role": "base model", "path": p, "fingerprint": "sha256:00"}
                                       for p in parents])
    try:
        lines = _listing(server, ck, tmp_path)
        outside.check("\n".join(lines))
    finally:
        outside.close()
        sock.close()
    assert len(lines) == 1 + len(parents), lines
    for line, (path, why) in zip(lines[1:], parents.items()):
        assert line.startswith(f"  base model: {path} (sha256:00) [{why}") and line.endswith("]"), (path, line)
        assert line.endswith((": not read]", ": not followed]")), line


def test_a_lineage_of_thousands_of_parents_stops_at_the_cap_in_one_line(server, tmp_path):
    from automodel_ckpt.export.lineage_walk import MAX_PARENTS

    inner = [{"role": "base model", "path": f"/gone/{i}"} for i in range(12)]
    parents = [{"role": "restored from", "path": f"/gone/p{i}", "lineage": {"parents": inner}} for i in range(200)]
    ck = _checkpoint(tmp_path / "ck", parents)
    lines = _listing(server, ck, tmp_path)
    assert lines[-1].strip() == f"... (more than {MAX_PARENTS} parents: the rest not shown)", lines[-3:]
    assert len(lines) == 1 + MAX_PARENTS + 1


def test_each_folder_is_fingerprinted_once_and_a_listing_reads_a_bounded_amount(capsys, tmp_path, monkeypatch):
    """With room for one 4 MiB manifest: a folder named 99 ways is hashed once (every line compared); a second
    folder with its own no longer fits and is named, not read."""
    from automodel_ckpt.export import lineage_walk

    monkeypatch.setattr(lineage_walk, "READ_LIMIT", 6 * MiB)
    big, other = _checkpoint(tmp_path / "big", []), _checkpoint(tmp_path / "other", [])
    _manifest(big, 4 * MiB)
    _manifest(other, 4 * MiB)
    named = [{"role": "base model", "path": str(big) + "/." * n, "fingerprint": "sha256:00"} for n in range(1, 100)]
    last = {"role": "restored from", "path": str(other), "fingerprint": "sha256:0"}
    ck = _checkpoint(tmp_path / "ck", [*named, last])
    code, out, err = _inspect(capsys, ck)
    assert code == 0, err
    lines = out.splitlines()
    assert sum("[changed: now sha256:" in line for line in lines) == 99, out[-2000:]
    assert lines[-1] == (f"  restored from: {other} (sha256:0) [present; not compared or followed: this listing has "
                         "read its 6.0 MiB]"), lines[-1]


def test_a_record_of_more_than_256_parents_says_how_many_are_not_shown(capsys, tmp_path):
    ck = _checkpoint(tmp_path / "ck", [{"role": "base model", "path": f"/gone/{i}"} for i in range(300)])
    code, out, err = _inspect(capsys, ck)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1 + 256 + 1 and lines[-1] == "  ... (44 more parents of this record: not shown)", lines[-2:]
