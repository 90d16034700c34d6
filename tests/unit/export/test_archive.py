"""`ckpt-train pack`: one tar that plain tar unpacks into the export, read in place by verify and inspect, and
hostile archives refused in one line."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.export import archive
from automodel_ckpt.export.archive_pack import pack
from automodel_ckpt.export.plan import consolidate
from automodel_ckpt.checkpoint.restore.initial_weights import kind_of
from automodel_ckpt.cli import main as cli_main
from automodel_ckpt.errors import CheckpointError
from tests.family_bases import build_family_base, checkpoint_of

RECIPE = "model:\n  pretrained_model_name_or_path: base\n  hf_token: hf_secret_value\nstep_scheduler:\n  max_steps: 4\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained llama checkpoint as ckpt-train writes it (2-rank shards, .hf_metadata, metadata, recipe)."""
    root = tmp_path_factory.mktemp("run")
    base = build_family_base("llama", root / "base")
    _, model_dir = checkpoint_of(base, root / "checkpoints", "safetensors", noise=1e-2)
    ckpt = model_dir.parent
    (ckpt / layout.METADATA_FILE).write_text(json.dumps({"name": ckpt.name, "step": 4, "epoch": 0}))
    (ckpt / layout.CONFIG_FILE).write_text(RECIPE)
    return ckpt


@pytest.fixture(scope="module")
def packed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "model.tar"
    pack(checkpoint, out, progress=False)
    return out


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter folder of a tiny llama, written by PEFT itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora
    from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG

    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG)), PeftConfig(init_lora_weights=False))
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(folder)
    return folder


def _unpack(path: Path, into: Path) -> Path:
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_packed_checkpoint_unpacks_into_its_export_and_our_files(checkpoint, packed, tmp_path):
    export = consolidate(checkpoint / layout.MODEL_DIR, tmp_path / "export", progress=False)
    unpacked = _files(_unpack(packed, tmp_path / "unpacked"))
    ours = {name: unpacked.pop(name) for name in list(unpacked) if name.startswith(layout.ARCHIVE_DIR + "/")}
    assert unpacked == _files(export)  # byte for byte: the export streamed into the archive, never staged
    assert set(ours) == {layout.ARCHIVE_RECIPE, layout.ARCHIVE_METADATA, layout.ARCHIVE_MANIFEST}
    assert b"hf_secret_value" not in ours[layout.ARCHIVE_RECIPE] and b"<redacted>" in ours[layout.ARCHIVE_RECIPE]
    assert json.loads(ours[layout.ARCHIVE_METADATA])["step"] == 4
    table = json.loads(ours[layout.ARCHIVE_MANIFEST])
    assert set(table["files"]) == set(unpacked) | {layout.ARCHIVE_RECIPE, layout.ARCHIVE_METADATA}
    assert sorted(p.name for p in packed.parent.iterdir()) == [packed.name]  # no temporary file left


def test_transformers_loads_the_unpacked_archive_with_the_exports_logits(checkpoint, packed, tmp_path):
    from transformers import AutoModelForCausalLM

    export = consolidate(checkpoint / layout.MODEL_DIR, tmp_path / "export", progress=False)
    unpacked = _unpack(packed, tmp_path / "unpacked")
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(export)).eval()(tokens).logits
        got = AutoModelForCausalLM.from_pretrained(str(unpacked)).eval()(tokens).logits
    assert torch.equal(got, want)


def test_every_weights_member_starts_its_data_on_a_4096_byte_boundary(packed):
    with tarfile.open(packed) as tar:
        weights = [m for m in tar.getmembers() if m.name.endswith(".safetensors")]
    assert len(weights) == 2 and all(m.offset_data % archive.ALIGN == 0 for m in weights)
    with archive.open_archive(packed) as opened:
        assert all(opened.members[m.name].offset == m.offset_data for m in weights)
        header, start = opened.safetensors_header(weights[0].name)
        assert header and start > 8


class _Stream:
    """What an object store's streamed upload offers ``pack_into``: ``write`` in order, and its ``part_size``."""

    def __init__(self, part_size: int) -> None:
        self.part_size, self.writes = part_size, []

    def write(self, data) -> None:
        self.writes.append(bytes(data))


@pytest.mark.parametrize("source", ["checkpoint", "export folder"])
def test_the_streamed_archive_is_the_file_archive_byte_for_byte_written_forward_in_parts(
        source, checkpoint, tmp_path, monkeypatch):
    import contextlib

    from automodel_ckpt.export import archive_pack as packing

    src = checkpoint
    if source == "export folder":
        pack(checkpoint, tmp_path / "x.tar", progress=False)
        src = _unpack(tmp_path / "x.tar", tmp_path / "folder")
    monkeypatch.setattr(packing.time, "time", lambda: 1_700_000_000)  # the same mtime in both
    monkeypatch.setattr(packing, "_COPY_CHUNK", 5000)  # files in several chunks, windows cut inside members
    pack(src, tmp_path / "file.tar", progress=False)
    stream = _Stream(part_size=3001)  # windows that end anywhere: inside headers, tensors, padding
    sizes = []
    table = packing.pack_into(src, lambda size: (sizes.append(size), contextlib.nullcontext(stream))[1],
                              progress=False, num_threads=3)
    assert b"".join(stream.writes) == (tmp_path / "file.tar").read_bytes()
    assert len(stream.writes) > 10 and all(len(w) >= 3001 for w in stream.writes[:-2])  # the manifest comes last
    assert all(len(w) < 3001 + 32 * 2**20 for w in stream.writes)
    assert sizes[0] <= len(b"".join(stream.writes)) and table["files"]


def test_an_adapter_folder_packs_and_unpacks_to_the_same_files(adapter, tmp_path):
    from peft import LoraConfig

    pack(adapter, tmp_path / "adapter.tar", progress=False)
    unpacked = _unpack(tmp_path / "adapter.tar", tmp_path / "unpacked")
    files = _files(unpacked)
    assert files.pop(layout.ARCHIVE_MANIFEST)
    assert files == _files(adapter)
    assert LoraConfig.from_pretrained(str(unpacked)).r == LoraConfig.from_pretrained(str(adapter)).r
    before, after = load_file(adapter / layout.ADAPTER_WEIGHTS), load_file(unpacked / layout.ADAPTER_WEIGHTS)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG

    torch.manual_seed(1)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG)), str(unpacked))
    in_model = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert in_model.keys() == after.keys()  # PEFT loads the unpacked archive as it is: every tensor in place
    assert all(torch.equal(in_model[k], after[k]) for k in after)


def test_an_unpacked_archive_packs_again_and_verifies(packed, tmp_path):
    unpacked = _unpack(packed, tmp_path / "unpacked")
    pack(unpacked, tmp_path / "again.tar", progress=False)
    again = _files(_unpack(tmp_path / "again.tar", tmp_path / "again"))
    first = _files(unpacked)
    assert again.pop(layout.ARCHIVE_MANIFEST) and first.pop(layout.ARCHIVE_MANIFEST)
    assert again == first
    assert archive.verify_archive(tmp_path / "again.tar").ok


def test_verify_and_inspect_read_the_archive_in_place(packed, capsys):
    assert cli_main(["verify", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "verify: OK" in out and out.count(" ok ") == 11
    assert cli_main(["inspect", str(packed), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model_type"], info["checkpoint"], info["step"], info["run"]) == ("llama", "epoch_0_step_4", 4,
                                                                                    "checkpoints")
    assert info["dtypes"] == {"BF16": info["parameters"]} and info["parameters"] > 0


def test_verify_catches_one_flipped_byte_in_any_member(packed, tmp_path):
    with archive.open_archive(packed) as opened:
        members = list(opened.members.values())
    assert len(members) == 11
    for member in members:
        damaged = tmp_path / "damaged.tar"
        shutil.copyfile(packed, damaged)
        with open(damaged, "r+b") as f:
            f.seek(member.offset + member.size // 2)
            byte = f.read(1)
            f.seek(-1, io.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        report = archive.verify_archive(damaged)
        assert not report.ok, member.name
        assert [v.path for v in report.bad][:1] == [member.name], member.name
        assert manifest.CHECKSUM_MISMATCH in {v.status for v in report.bad} or report.problem, member.name


def test_a_link_in_a_folder_to_pack_is_refused_in_one_line(adapter, tmp_path):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    (folder / "tokenizer.json").symlink_to("/proc/self/environ")
    with pytest.raises(CheckpointError, match="symlink, not a regular file") as caught:
        pack(folder, tmp_path / "out.tar", progress=False)
    assert "\n" not in str(caught.value) and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


# --- hostile archives ------------------------------------------------------------------------------------------
def _hostile(path: Path, case: str) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes = b"x", **fields) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)

        add(layout.HF_CONFIG, b"{}")
        if case == "absolute":
            add("/tmp/evil.json")
        elif case == "dotdot":
            add("../evil.json")
        elif case == "dotdot_inside":
            add("sub/../../evil.json")
        elif case == "symlink":
            add("tokenizer.json", b"", type=tarfile.SYMTYPE, linkname="/proc/self/environ")
        elif case == "hardlink":
            add("tokenizer.json", b"", type=tarfile.LNKTYPE, linkname="/etc/passwd")
        elif case == "device":
            add("tokenizer.json", b"", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        elif case == "fifo":
            add("tokenizer.json", b"", type=tarfile.FIFOTYPE)
        elif case == "duplicate":
            add(layout.HF_CONFIG, b"{}")
        elif case == "huge_extended_header":
            add("tokenizer.json", pax_headers={"comment": "0" * (2 << 20)})
        elif case in ("past_end", "garbage_after"):
            add("model-00001-of-00001.safetensors", b"\0" * 100_000)
    if case == "past_end":
        with open(path, "r+b") as f:
            f.truncate(4096)
    elif case == "garbage_after":  # where the end-of-archive blocks belong: neither a header nor the end
        with open(path, "r+b") as f:
            f.seek(3 * 512 + 100_000 + (-100_000 % 512))  # two headers, the config, the weights
            f.write(b"garbage" * 10)
    return path


HOSTILE = ["absolute", "dotdot", "dotdot_inside", "symlink", "hardlink", "device", "fifo", "duplicate",
           "huge_extended_header", "past_end", "garbage_after"]


@pytest.mark.parametrize("case", HOSTILE)
def test_each_hostile_archive_is_refused_in_one_line_by_every_reader(case, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    path = _hostile(work / "model.tar", case)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError) as caught:
        archive.open_archive(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "refused" in message
    for argv in (["verify", str(path)], ["inspect", str(path)]):
        assert cli_main(argv) == CheckpointError.exit_code, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: the archive") and "\n" not in err
    with pytest.raises(CheckpointError, match="refused"):  # restore_from: the same checks, before any read
        kind_of(path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, nothing extracted
    assert not (tmp_path / "evil.json").exists() and not Path("/tmp/evil.json").exists()


def test_a_hand_made_archive_of_the_same_files_reads_and_verifies(packed, tmp_path):
    """`tar cf` of the unpacked folder (``./`` names, folder entries, no alignment) holds the same files."""
    unpacked = _unpack(packed, tmp_path / "unpacked")
    with tarfile.open(tmp_path / "hand.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(unpacked, arcname=".")
    report = archive.verify_archive(tmp_path / "hand.tar")
    assert [(v.path, v.status) for v in report.bad] == [(layout.ARCHIVE_MANIFEST, manifest.UNREADABLE)]
    assert report.problem is None and len(report.verdicts) == 11


def test_restore_from_reads_the_same_weights_from_the_archive_as_from_the_folder(packed, tmp_path, process_group):
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel_ckpt.checkpoint.restore.hf_weights import load_hf_folder

    folder = _unpack(packed, tmp_path / "unpacked")
    assert kind_of(packed) == kind_of(folder)
    config = AutoConfig.from_pretrained(folder)
    loaded = []
    for source in (folder, packed):
        torch.manual_seed(len(loaded))  # another start each time: equal after the load only if both load it all
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        load_hf_folder(model, source, rank=0)
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])
    assert sorted(p.name for p in packed.parent.iterdir()) == [packed.name]  # nothing extracted beside it


def test_merge_lora_reads_an_archived_adapter_in_place_and_merges_as_from_the_folder(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora
    from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))
    base.save_pretrained(tmp_path / "base")
    apply_lora(base, PeftConfig(init_lora_weights=False)).save_pretrained(tmp_path / "adapter")
    pack(tmp_path / "adapter", tmp_path / "adapter.tar", progress=False)
    assert cli_main(["merge-lora", str(tmp_path / "adapter.tar"), "--base", str(tmp_path / "base")]) == 0
    assert f"Merged model written to {tmp_path / 'adapter-merged'}" in capsys.readouterr().out
    assert cli_main(["merge-lora", str(tmp_path / "adapter"), "--base", str(tmp_path / "base"),
                     "--out", str(tmp_path / "from-folder")]) == 0
    from_archive = load_file(tmp_path / "adapter-merged" / "model.safetensors")
    from_folder = load_file(tmp_path / "from-folder" / "model.safetensors")
    plain = load_file(tmp_path / "base" / "model.safetensors")
    assert from_archive.keys() == from_folder.keys()
    assert all(torch.equal(from_archive[k], from_folder[k]) for k in from_folder)
    assert any(not torch.equal(from_archive[k], plain[k]) for k in plain)  # the adapter was merged in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "adapter-merged", "adapter.tar", "base",
                                                          "from-folder"]  # nothing extracted


def test_merge_lora_of_a_full_models_archive_is_one_line(packed, capsys):
    assert cli_main(["merge-lora", str(packed)]) != 0
    assert "holds no PEFT adapter" in capsys.readouterr().err


def test_a_source_that_ends_during_a_kernel_copy_is_named_in_one_line(tmp_path):
    """The kernel copy of an export or an archive meets a source file shorter than its plan: the error names the
    file (as its caller words it), nothing is reported as copied past the end."""
    import os

    from automodel_ckpt.export.writer import kernel_copy

    src, dst = tmp_path / "shard.safetensors", tmp_path / "out"
    src.write_bytes(b"x" * 100)
    copied: list[int] = []
    with open(src, "rb") as s, open(dst, "wb") as d:
        if not hasattr(os, "copy_file_range") or not kernel_copy(s.fileno(), d.fileno(), 0, 0, 10):
            pytest.skip("this filesystem copies in user space (no copy_file_range)")
        with pytest.raises(CheckpointError, match=r"^'.*shard\.safetensors' changed while it was packed; pack again$"):
            kernel_copy(s.fileno(), d.fileno(), 0, 0, 200, copied.append,
                        f"'{src}' changed while it was packed; pack again")
    assert sum(copied) == 100
