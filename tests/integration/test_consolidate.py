"""HF export of sharded checkpoints: loadable, dtype-faithful, base file layout, multi-rank identical, atomic."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from automodel_ckpt.ondisk import layout
from automodel_ckpt.export.plan import consolidate, render_consolidate_script
from automodel_ckpt.cli import main as ckpt_train_main
from automodel_ckpt.cli.consolidate import parse_size
from automodel_ckpt.export.hf_metadata import read_hf_metadata, write_hf_metadata
from automodel_ckpt.errors import CheckpointError, UserError
from tests.integration.harness import launch_failure

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# Two ranks: FSDP2-shard a model loaded from the bf16 base (in fp32, slightly "trained"), save its model state
# as per-rank safetensors shards and as DCP files, and keep the full fp32 state for comparison.
_GENERATOR = r"""
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM

root = sys.argv[1]
dist.init_process_group("gloo")
model = LlamaForCausalLM.from_pretrained(os.path.join(root, "base"), dtype=torch.float32, attn_implementation="eager")
torch.manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 1e-3)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
sd = get_model_state_dict(model)
dcp.save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(root, "st", "model"), save_distributed=True))
dcp.save(sd, checkpoint_id=os.path.join(root, "ts", "model"))
full = {k: v.full_tensor() for k, v in sd.items()}
if dist.get_rank() == 0:
    torch.save(full, os.path.join(root, "full.pt"))
from automodel_ckpt.distributed.env import end_process, shutdown_distributed
shutdown_distributed()
end_process(0)
"""


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(46)} | {"<unk>": 46, "<s>": 47, "</s>": 48}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> Path:
    """root/{base (bf16 HF folder, 2 files), st/model (safetensors shards), ts/model (DCP), full.pt}."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("consolidate")
    cfg = LlamaConfig(
        vocab_size=49,  # odd: the two ranks hold pieces of different sizes
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=47,
        eos_token_id=48,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "base", max_shard_size="30KB")
    assert len(json.loads((root / "base" / layout.HF_INDEX).read_text())["weight_map"]) == 21
    assert len(list((root / "base").glob("model-*.safetensors"))) == 2
    _tokenizer().save_pretrained(root / "base")
    script = root / "gen.py"
    script.write_text(_GENERATOR)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(root)]
    for attempt in range(2):  # a second launch when the first lost its free port to a concurrent launch
        shutil.rmtree(root / "st", ignore_errors=True)
        shutil.rmtree(root / "ts", ignore_errors=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            break
    assert done.returncode == 0, launch_failure(done)
    base_cfg = AutoConfig.from_pretrained(root / "base")
    write_hf_metadata(root / "st" / "model", hf_config=base_cfg, tokenizer=_tokenizer(), base_model_path=root / "base", world_size=2)
    write_hf_metadata(root / "ts" / "model", hf_config=base_cfg, base_model_path=root / "base", world_size=2)
    return root


@pytest.fixture(scope="session")
def full_state(shards) -> dict[str, torch.Tensor]:
    return torch.load(shards / "full.pt")


@pytest.fixture(scope="session")
def reference_export(shards, tmp_path_factory) -> Path:
    """Single-process export of the safetensors shards, for byte comparisons."""
    return consolidate(shards / "st" / "model", tmp_path_factory.mktemp("ref") / "out", progress=False)


def _copy_model(shards: Path, fmt: str, tmp_path: Path) -> Path:
    model_dir = tmp_path / "epoch_0_step_4" / layout.MODEL_DIR
    shutil.copytree(shards / fmt / "model", model_dir)
    return model_dir


def _load_export(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / layout.HF_INDEX).read_text())
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(out / name))
    assert set(state) == set(index["weight_map"])
    return state


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _no_leftovers(model_dir: Path, name: str = layout.CONSOLIDATED_DIR) -> None:
    assert not (model_dir / name).exists()
    assert [p.name for p in model_dir.iterdir() if p.name.startswith(f".{name}")] == []


# ---------------------------------------------------------------------------------------------- exports
def test_export_restores_base_dtype_and_layout_and_loads(shards, full_state, reference_export):
    from transformers import AutoModelForCausalLM, pipeline

    out = reference_export
    state = _load_export(out)
    assert state.keys() == full_state.keys()
    for name, value in full_state.items():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    index = json.loads((out / layout.HF_INDEX).read_text())
    base_index = json.loads((shards / "base" / layout.HF_INDEX).read_text())
    assert index["weight_map"] == base_index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in full_state.values())
    assert json.loads((out / layout.HF_CONFIG).read_text())["dtype"] == "bfloat16"
    assert (out / layout.HF_GENERATION_CONFIG).is_file() and (out / "tokenizer.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    for name, value in model.state_dict().items():
        assert torch.equal(value, full_state[name].to(torch.bfloat16)), name
    generated = pipeline("text-generation", model=str(out))("w1 w2", max_new_tokens=3, do_sample=False)
    assert generated[0]["generated_text"].startswith("w1 w2")


def test_output_files_are_byte_identical_to_safetensors_own(reference_export, tmp_path):
    for path in reference_export.glob("model-*.safetensors"):
        save_file(load_file(path), tmp_path / path.name, metadata={"format": "pt"})
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def test_torch_save_export_equals_safetensors_export(shards, reference_export, tmp_path):
    model_dir = _copy_model(shards, "ts", tmp_path)
    out = consolidate(model_dir.parent, progress=False)  # the checkpoint folder is accepted too
    assert out == model_dir / layout.CONSOLIDATED_DIR
    ref = _files(reference_export)
    got = _files(out)
    assert got.keys() == ref.keys()
    for name in ref:
        if name.endswith(".safetensors") or name == layout.HF_INDEX or name == layout.HF_CONFIG:
            assert got[name] == ref[name], name


def test_cast_fp32_and_config_dtype(shards, full_state, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    out = consolidate(model_dir, cast_dtype="fp32", progress=False)
    state = _load_export(out)
    for name, value in full_state.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name
    assert json.loads((out / layout.HF_CONFIG).read_text())["dtype"] == "float32"


def test_without_base_keeps_saved_dtype_and_splits_by_size(shards, full_state, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = _copy_model(shards, "st", tmp_path)
    write_hf_metadata(model_dir, hf_config=AutoConfig.from_pretrained(shards / "base"), tokenizer=_tokenizer())
    assert read_hf_metadata(model_dir).original is None
    max_size = 20_000
    out = consolidate(model_dir, max_shard_size=max_size, progress=False)
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2
    assert files[0].name == layout.hf_weights_file(1, len(files))
    for f in files:
        tensors = load_file(f)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= max_size or len(tensors) == 1
    state = _load_export(out)
    for name, value in full_state.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert json.loads((out / layout.HF_CONFIG).read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32


def test_without_kernel_copy_same_bytes(shards, reference_export, tmp_path, monkeypatch):
    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device copy not supported")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    out = consolidate(shards / "st" / "model", tmp_path / "out", cast_dtype="fp32", progress=False)
    reference = consolidate(shards / "st" / "model", tmp_path / "ref", cast_dtype="fp32", num_threads=1, progress=False)
    assert _files(out) == _files(reference)


def test_world_size_2_is_byte_identical(shards, reference_export, tmp_path):
    model_dir = shards / "st" / "model"
    out = tmp_path / "out"
    # Without a process group, ranks coordinate through marker files; rank 0 renames once rank 1 is done.
    consolidate(model_dir, out, rank=1, world_size=2, progress=False)
    assert not out.exists()
    consolidate(model_dir, out, rank=0, world_size=2, progress=False)
    assert _files(out) == _files(reference_export)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_second_run_replaces_the_export(shards, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    out = consolidate(model_dir, progress=False)
    (out / "stale.txt").write_text("from an older export")
    consolidate(model_dir, progress=False)
    assert not (out / "stale.txt").exists()
    assert [p.name for p in model_dir.iterdir() if p.name.startswith(".consolidated")] == []


# ---------------------------------------------------------------------------------------------- dtype rules
def _write_rank_files(model_dir: Path, ranks: list[dict[str, tuple[torch.Tensor, list[int]]]]) -> None:
    """Shard files like torch's HuggingFaceStorageWriter: local pieces plus their offsets in DCP_SHARDING_INFO."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for rank, pieces in enumerate(ranks):
        info = {name: {"saved_offsets": offsets} for name, (_, offsets) in pieces.items()}
        tensors = {name: t.contiguous() for name, (t, _) in pieces.items()}
        meta = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
        save_file(tensors, model_dir / layout.model_shard_file(rank, 1, 1), metadata=meta)


def test_fp8_and_integer_tensors_are_never_cast_and_column_splits_assemble(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(6, 8)
    q = torch.randint(-100, 100, (4, 3), dtype=torch.int8)
    f8 = torch.randn(4, 2).to(torch.float8_e4m3fn)
    model_dir = tmp_path / "model"
    _write_rank_files(
        model_dir,
        [
            {"w": (w[:, :5], [0, 0]), "q": (q[:2], [0, 0]), "f8": (f8[:2], [0, 0])},
            {"w": (w[:, 5:], [0, 5]), "q": (q[2:], [2, 0]), "f8": (f8[2:], [2, 0])},
        ],
    )
    out = consolidate(model_dir, cast_dtype="bf16", progress=False)
    state = _load_export(out)
    assert torch.equal(state["w"], w.to(torch.bfloat16))
    assert torch.equal(state["q"], q)
    assert state["f8"].dtype == torch.float8_e4m3fn and torch.equal(state["f8"].view(torch.uint8), f8.view(torch.uint8))
    assert not (out / layout.HF_CONFIG).exists()  # no .hf_metadata: weights and index only


def _float_shards_of_an_int8_base(tmp_path):
    """Float shards of a tensor whose base stored it as int8 (quantized); returns the model folder and the tensor."""
    model_dir = tmp_path / "model"
    w = torch.randn(4, 4)
    _write_rank_files(model_dir, [{"w": (w[:2], [0, 0])}, {"w": (w[2:], [2, 0])}])
    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(4, 4, dtype=torch.int8)}, base / layout.HF_SINGLE_WEIGHTS)
    write_hf_metadata(model_dir, hf_config={"model_type": "llama"}, base_model_path=base)
    return model_dir, w


def test_quantized_original_saved_as_float_warns_and_stays_float(tmp_path):
    model_dir, w = _float_shards_of_an_int8_base(tmp_path)
    meta = read_hf_metadata(model_dir)
    assert meta.original_num_files == 1 and meta.original["w"].dtype == "I8" and meta.original["w"].file == 1
    with pytest.warns(UserWarning, match="quantized or packed"):
        out = consolidate(model_dir, progress=False)
    assert torch.equal(load_file(out / layout.hf_weights_file(1, 1))["w"], w)


def test_unknown_cast_dtype(tmp_path):
    with pytest.raises(UserError) as err:
        consolidate(tmp_path, cast_dtype="int4")
    assert str(err.value) == "unknown CAST_DTYPE 'int4'; use one of bf16, fp16, fp32, fp64"


# ---------------------------------------------------------------------------------------------- errors
def test_truncated_shard(shards, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    shard = model_dir / layout.model_shard_file(1, 1, 1)
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=f"truncated shard file .*{shard.name}"):
        consolidate(model_dir, progress=False)
    _no_leftovers(model_dir)


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_shard_file(shards, tmp_path, rank):
    model_dir = _copy_model(shards, "st", tmp_path)
    shard = model_dir / layout.model_shard_file(rank, 1, 1)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file .*{shard.name}"):
        consolidate(model_dir, progress=False)
    _no_leftovers(model_dir)


def test_missing_and_truncated_dcp_files(shards, tmp_path):
    model_dir = _copy_model(shards, "ts", tmp_path)
    distcp = model_dir / layout.dcp_rank_file(1)
    os.truncate(distcp, distcp.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"truncated shard file .*{distcp.name}"):
        consolidate(model_dir, progress=False)
    distcp.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file .*{distcp.name}"):
        consolidate(model_dir, progress=False)
    _no_leftovers(model_dir)


def test_overlapping_and_missing_pieces(tmp_path):
    w = torch.randn(6, 4)
    overlap = tmp_path / "overlap"
    _write_rank_files(overlap, [{"w": (w[:4], [0, 0])}, {"w": (w[3:], [3, 0])}])
    with pytest.raises(CheckpointError, match="overlapping pieces of 'w'"):
        consolidate(overlap, progress=False)
    _no_leftovers(overlap)
    gap = tmp_path / "gap"
    _write_rank_files(gap, [{"w": (w[:2], [0, 0])}, {"w": (w[3:], [3, 0])}])
    with pytest.raises(CheckpointError, match="rows 2..3 of 'w' are in no shard file"):
        consolidate(gap, progress=False)
    _no_leftovers(gap)


def test_unwritable_output(shards, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="not writable"):
        consolidate(shards / "st" / "model", blocker / "out", progress=False)
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(CheckpointError, match="not writable"):
            consolidate(shards / "st" / "model", locked / "out", progress=False)


def test_refuses_to_replace_what_is_not_an_export(shards, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    for out in (model_dir, model_dir.parent):
        with pytest.raises(UserError, match="must not be the model folder"):
            consolidate(model_dir, out, progress=False)
    other = tmp_path / "my_models"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an earlier export"):
        consolidate(model_dir, other, progress=False)
    assert (other / "notes.txt").read_text() == "keep me"


def test_empty_or_absent_model_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate(tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model shards"):
        consolidate(tmp_path / "empty", progress=False)
    _no_leftovers(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------- CLI and script
def test_cli(shards, reference_export, tmp_path, capsys):
    model_dir = _copy_model(shards, "st", tmp_path)
    assert ckpt_train_main(["consolidate", str(model_dir.parent), "--no-progress", "--max-shard-size", "1MB"]) == 0
    assert _files(model_dir / layout.CONSOLIDATED_DIR) == _files(reference_export)
    capsys.readouterr()
    for given in (model_dir.parent, model_dir / layout.CONSOLIDATED_DIR):  # the checkpoint, or the export itself
        assert ckpt_train_main(["verify", "--export", str(given)]) == 0
        assert capsys.readouterr().out.rstrip().endswith("verify: OK")
    assert ckpt_train_main(["consolidate", str(tmp_path / "nope"), "--no-progress"]) == CheckpointError.exit_code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model folder") and "\n" not in err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("123") == 123


def _bash(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": PYTHON, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def test_consolidate_sh_from_any_directory_twice_and_sourced(shards, reference_export, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    render_consolidate_script(model_dir)
    script = model_dir / layout.CONSOLIDATE_SCRIPT
    assert script.stat().st_mode & 0o777 == 0o755
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = _bash([f"../{script.relative_to(tmp_path).as_posix()}"], elsewhere)
    assert result.returncode == 0, result.stderr
    assert _files(model_dir / layout.CONSOLIDATED_DIR) == _files(reference_export)
    (model_dir / layout.CONSOLIDATED_DIR / "stale.txt").write_text("replaced by the second run")
    # Second run, sourced: the calling shell keeps its options, variables and directory, and survives a failure.
    probe = (
        'cd "$1"; source "$2" >/dev/null 2>&1; echo "rc=$?"; pwd; set -o | grep -E "^(errexit|nounset|pipefail)"; '
        "declare -p model_dir python_bin args nproc 2>/dev/null | wc -l; "
        'CAST_DTYPE=bogus source "$2" >/dev/null 2>&1; echo "rc=$?"; echo alive'
    )
    result = _bash(["-c", probe, "_", str(elsewhere), str(script)], tmp_path)
    lines = result.stdout.split("\n")
    assert lines[0] == "rc=0", result
    assert lines[1] == str(elsewhere)
    assert len(lines[2:5]) == 3 and all(line.split()[-1] == "off" for line in lines[2:5]), lines
    assert lines[5].strip() == "0"
    assert lines[6] == f"rc={UserError.exit_code}" and lines[7] == "alive"
    assert _files(model_dir / layout.CONSOLIDATED_DIR) == _files(reference_export)


def test_consolidate_sh_with_two_processes(shards, reference_export, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    render_consolidate_script(model_dir)
    result = _bash([str(model_dir / layout.CONSOLIDATE_SCRIPT)], tmp_path, NPROC_PER_NODE="2", NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    assert _files(model_dir / layout.CONSOLIDATED_DIR) == _files(reference_export)
    assert [p.name for p in model_dir.iterdir() if p.name.startswith(".consolidated")] == []


def test_offline_tool_wrapper(shards, reference_export, tmp_path):
    model_dir = _copy_model(shards, "st", tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tool = REPO / "tools" / "offline_hf_consolidation.py"
    result = subprocess.run(
        [PYTHON, str(tool), str(model_dir), "--out", str(tmp_path / "hf"), "--cast-dtype", "bf16", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path / "hf") == _files(reference_export)


def test_the_quantized_warning_is_reported_once(tmp_path, caplog):
    """One report per problem: a warning (the CLI prints it as one `warning:` line), not a log line as well."""
    model_dir, w = _float_shards_of_an_int8_base(tmp_path)
    caplog.set_level("INFO", logger="automodel_ckpt")
    with pytest.warns(UserWarning, match="quantized or packed") as warned:
        consolidate(model_dir, progress=False)
    assert len([w for w in warned if "quantized or packed" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "quantized or packed" in r.getMessage()]


def test_a_consolidate_sh_of_the_previous_release_still_exports(shards, reference_export, tmp_path):
    """Checkpoints written by 0.1.0 hold a consolidate.sh that runs `python -m automodel_ckpt.checkpoint.consolidate_cli`."""
    import shlex

    model_dir = _copy_model(shards, "st", tmp_path)
    old = (REPO / "tests" / "fixtures" / "consolidate_sh_0.1.0.txt").read_text(encoding="utf-8")
    assert "-m automodel_ckpt.checkpoint.consolidate_cli" in old
    script = model_dir / layout.CONSOLIDATE_SCRIPT
    script.write_text(old.replace("@PYTHON@", shlex.quote(PYTHON)).replace("@PACKAGE_ROOT@", shlex.quote(str(REPO))))
    result = _bash([str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert _files(model_dir / layout.CONSOLIDATED_DIR) == _files(reference_export)


class _Evil:
    """A pickle that would create ``marker`` when unpickled by torch's plain reader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_dcp_metadata_never_runs_in_consolidate_sh_consolidate_or_verify_export(shards, tmp_path, capsys):
    """A torch_save checkpoint from elsewhere whose model/.metadata runs a command when unpickled: every verb that
    reads it (consolidate.sh, `ckpt-train consolidate`, `ckpt-train verify --export`) refuses it in one line."""
    import pickle

    model_dir = _copy_model(shards, "ts", tmp_path)
    assert ckpt_train_main(["consolidate", str(model_dir.parent), "--no-progress"]) == 0  # an export to verify
    marker = tmp_path / "pwned"
    metadata = model_dir / layout.DCP_METADATA
    metadata.write_bytes(pickle.dumps(_Evil(marker)))
    expected = f"error: refusing to load '{metadata}': global 'posix.system' is not allowed in checkpoint metadata"
    render_consolidate_script(model_dir)
    result = _bash([str(model_dir / layout.CONSOLIDATE_SCRIPT)], tmp_path)
    assert (result.returncode, result.stderr.strip()) == (CheckpointError.exit_code, expected)
    capsys.readouterr()
    assert ckpt_train_main(["consolidate", str(model_dir.parent), "--no-progress"]) == CheckpointError.exit_code
    assert capsys.readouterr().err.strip() == expected
    assert ckpt_train_main(["verify", "--export", str(model_dir.parent)]) == CheckpointError.exit_code
    err = capsys.readouterr().err  # transformers' reload of the export comes first, then the shards are read
    assert [line for line in err.splitlines() if "error" in line.lower()] == [expected], err
    assert not marker.exists()
