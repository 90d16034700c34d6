"""Lineage read from files is data: a parent outside the folder named is printed and only looked up as a regular
folder (never through a link), a record over 1 MiB is refused in one line (metadata, export folder file, GGUF key),
and escape codes in a name are printed escaped, each parent on one line. No training: records written by hand."""

from __future__ import annotations

import json
from pathlib import Path

from automodel_ckpt.cli import main
from automodel_ckpt.ondisk import layout

LINEAGE_FILE = layout.LINEAGE_FILE


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
    assert "  base model: /etc (sha256:33) [present]" in lines  # a folder with no record of ours: nothing below


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
