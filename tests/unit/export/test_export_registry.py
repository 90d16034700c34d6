"""An export target is a module and one register line: a toy target, registered here, runs through `ckpt-train
export --to toy` in-process, and `inspect`, `verify`, `pack`, `diff` and the lineage reader ask the registry what its
file is."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel_ckpt.cli import main
from automodel_ckpt.errors import CheckpointError, UsageError
from automodel_ckpt.export import (ExportRequest, ExportTarget, ModelSource, get_target, identify, read_lineage,
                                   register_target, target_names, unregister_target)

MAGIC = b"TOY-LIST\n"


class ToyTarget(ExportTarget):
    """The file names of SRC, one a line, after a magic line."""

    name = "toy"
    summary = "the names of SRC's files, one a line"
    noun = "a toy list"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--toy-upper", action="store_true", help="toy: the names in upper case")

    def refuse(self, args: Any) -> None:
        if args.toy_upper:
            raise UsageError(f"--toy-upper applies to --to {self.name} only")

    def export(self, request: ExportRequest) -> int:
        names = sorted(p.name for p in request.src.iterdir())
        out = request.out("-toy.txt")
        if not request.args.dry_run:
            out.write_bytes(MAGIC + "".join(f"{n.upper() if request.args.toy_upper else n}\n" for n in names).encode())
        print(f"toy list of {len(names)} names {'would be ' if request.args.dry_run else ''}written to {out}")
        return 0

    def identify(self, path: Path) -> bool:
        return path.is_file() and path.read_bytes()[:len(MAGIC)] == MAGIC

    def describe(self, path: Path) -> dict[str, Any]:
        return {"toy": str(path), "names": path.read_bytes().count(b"\n") - 1}

    def render(self, info: dict[str, Any]) -> str:
        return f"toy list {info['toy']}: {info['names']} names"

    def verify(self, path: Path, *, decode: bool) -> bool:
        ok = path.read_bytes().endswith(b"\n")
        print(f"toy list {path}: {'OK' if ok else 'FAILED: cut short'}")
        return ok


@pytest.fixture
def toy():
    target = register_target(ToyTarget())  # the one register line
    try:
        yield target
    finally:
        unregister_target(target.name)
    assert "toy" not in target_names()


def test_a_registered_target_exports_through_the_verb_and_its_file_is_known_to_inspect_and_verify(toy, tmp_path,
                                                                                                   capsys):
    src = tmp_path / "model"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).write_text("{}")
    assert get_target("toy") is toy and "toy" in target_names()
    assert main(["export", str(src), "--to", "toy", "--toy-upper"]) == 0
    out = tmp_path / "model-toy.txt"  # beside SRC, named by the target
    assert out.read_bytes() == MAGIC + b"CONFIG.JSON\nMODEL.SAFETENSORS\n"
    assert f"toy list of 2 names written to {out}" in capsys.readouterr().out
    assert main(["export", str(src), "--to", "toy", "--dry-run", "--out", str(tmp_path / "x.txt")]) == 0
    assert not (tmp_path / "x.txt").exists() and "would be written" in capsys.readouterr().out

    assert identify(out) is toy and identify(src) is None
    assert main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"toy list {out}: 2 names"
    assert main(["inspect", str(out), "--cost"]) == 2
    assert "--cost: needs a run folder, not a toy list" in capsys.readouterr().err
    assert main(["verify", str(out)]) == 0
    assert f"toy list {out}: OK" in capsys.readouterr().out
    out.write_bytes(MAGIC + b"CUT")
    assert main(["verify", str(out)]) == 1


def test_a_target_s_options_are_its_own(toy, tmp_path, capsys):
    from automodel_ckpt.cli.export import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--toy-upper toy: the names in upper case" in text and "toy, the names of SRC's files" in text
    assert main(["export", str(tmp_path), "--to", "int8", "--toy-upper"]) == 2  # refused before int8 reads anything
    assert "--toy-upper applies to --to toy only" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--to", "toy", "--calibrate", "2"]) == 2  # int8's option, not the toy's
    assert "--calibrate applies to --to int8 only" in capsys.readouterr().err


class ToyFileTarget(ToyTarget):
    """The toy list as a kind of file the other verbs meet: packed whole, compared by its names, its lineage read."""

    name = "toy-file"
    suffix = ".toy"

    def check(self, path: Path, consequence: str) -> None:
        if not path.read_bytes().endswith(b"\n"):
            raise CheckpointError(f"damaged toy list '{path}': cut short; {consequence}")

    def lineage_text(self, path: Path, limit: int) -> str | None:
        return json.dumps({"parents": [{"role": "exported from", "path": "model", "fingerprint": None}]})

    def open_tensors(self, path: Path, stack: Any) -> ModelSource:
        out = ModelSource({}, where=str(path))
        for name in path.read_bytes()[len(MAGIC):].decode().split():
            out.add(name, (1,), torch.float32, lambda name=name: torch.tensor([float(len(name))]))
        return out

    def beside(self, model: ModelSource, path: Path, stack: Any) -> tuple[ModelSource, ModelSource]:
        return model, self.open_tensors(path, stack)


@pytest.fixture
def toy_file():
    target = register_target(ToyFileTarget())
    try:
        yield target
    finally:
        unregister_target(target.name)


def test_pack_diff_and_lineage_ask_a_registered_file_target(toy_file, tmp_path, capsys):
    a, b, cut = tmp_path / "a.toy", tmp_path / "b.toy", tmp_path / "cut.toy"
    a.write_bytes(MAGIC + b"x\nyy\n")
    b.write_bytes(MAGIC + b"x\nzzz\n")
    cut.write_bytes(MAGIC + b"x")
    assert identify(a) is toy_file
    assert main(["pack", str(a), "--out", str(tmp_path / "a.tar"), "--no-progress"]) == 0
    with tarfile.open(tmp_path / "a.tar") as tar:
        member = tar.getmember(a.name)
        assert tar.extractfile(member).read() == a.read_bytes()
        assert member.offset_data % 4096 == 0  # aligned as a file named with a target's suffix
    assert main(["pack", str(cut), "--out", str(tmp_path / "cut.tar")]) != 0
    assert "cut short; it is not packed" in capsys.readouterr().err
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 1  # yy in a only, zzz in b only
    assert read_lineage(a)["parents"][0]["role"] == "exported from"
