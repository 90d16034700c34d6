"""``checkpoint.incremental`` in-process: stable tensors in files of their own, hard-linked from the last checkpoint
when unchanged; every checkpoint folder still complete, verifying and loading bit for bit.

A one-rank process group and a small model whose first layer is frozen (no gradients, no optimizer state).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.distributed.env import init_distributed
from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.ondisk.incremental import shared_bytes, stored_once
from tests.unit.checkpoint import ckpt_state

FORMATS = ("safetensors", "torch_save")


@pytest.fixture(scope="module")
def env():
    return init_distributed()


class Frozen(ckpt_state.State):
    """``ckpt_state.State`` with its first layer frozen, the optimizer over the rest only."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(hidden=64, layers=3, seed=seed)
        for p in self.model[0].parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)


def make(env, root: Path, fmt: str, *, incremental: bool = True, keep: int | None = None,
         is_async: bool = False) -> Checkpointer:
    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated="false",
                           incremental=incremental, max_recent_checkpoints=keep, is_async=is_async)
    return Checkpointer(cfg, env, resolved_config_yaml="checkpoint: {incremental: true}\n", say=lambda _m: None)


def info(step: int) -> SaveInfo:
    return SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False)


def stable_files(ckpt: Path) -> list[Path]:
    model = ckpt / layout.MODEL_DIR
    return sorted(p for p in model.iterdir() if p.name.endswith(f"-00002-of-{layout.INCREMENTAL_SHARDS:05d}.safetensors")
                  or p.name.endswith(f"_{layout.STABLE_DCP_INDEX}.distcp"))


def saves(env, root: Path, fmt: str, steps: int, **kw) -> tuple[Frozen, list[Path]]:
    state, ck, paths = Frozen(), make(env, root, fmt, **kw), []
    for step in range(1, steps + 1):
        state.step()
        paths.append(ck.save(state.states(), info(step)))
        ck.wait()
    ck.finalize()
    return state, paths


@pytest.mark.parametrize("fmt,is_async", [("safetensors", False), ("torch_save", False), ("torch_save", True)])
def test_unchanged_frozen_tensors_are_linked_and_every_checkpoint_loads_bit_for_bit(env, tmp_path, fmt, is_async):
    state, paths = saves(env, tmp_path, fmt, 3, is_async=is_async)
    first, *later = paths
    stable = stable_files(first)
    assert stable, sorted(p.name for p in (first / layout.MODEL_DIR).iterdir())
    for ckpt in later:  # the same inode: stored once, every folder complete
        assert [os.stat(p).st_ino for p in stable_files(ckpt)] == [os.stat(p).st_ino for p in stable]
        table = manifest.read_manifest(ckpt)
        assert table["linked_bytes"] == sum(p.stat().st_size for p in stable)
        assert manifest.verify_manifest(ckpt).ok
        own, shared = shared_bytes(ckpt)
        assert shared == table["linked_bytes"]
        assert own + shared == table["total_bytes"] + (ckpt / layout.MANIFEST_FILE).stat().st_size
    assert "linked_bytes" not in manifest.read_manifest(first)  # the first save wrote every byte
    assert stored_once(paths) == sum(p.stat().st_size for c in paths for p in c.rglob("*") if p.is_file()) - 2 * sum(
        p.stat().st_size for p in stable)
    fresh = Frozen(seed=1)
    fresh.step()
    make(env, tmp_path, fmt).load(fresh.states(), paths[-1])
    for k, v in state.snapshot().items():
        assert torch.equal(fresh.snapshot()[k], v), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_frozen_tensor_that_changed_is_written_again(env, tmp_path, fmt):
    """A reference synced from the policy (or any change to a stable tensor): the file differs, so it is written."""
    state, ck = Frozen(), make(env, tmp_path, fmt)
    one = ck.save(state.states(), info(1))
    with torch.no_grad():
        state.model[0].weight.add_(1.0)
    two = ck.save(state.states(), info(2))
    ck.finalize()
    assert [os.stat(p).st_ino for p in stable_files(one)] != [os.stat(p).st_ino for p in stable_files(two)]
    assert "linked_bytes" not in manifest.read_manifest(two) and manifest.verify_manifest(two).ok
    fresh = Frozen(seed=3)
    make(env, tmp_path, fmt).load(fresh.states(), two)
    assert torch.equal(fresh.model[0].weight, state.model[0].weight)


def test_keep_last_one_leaves_only_what_the_last_checkpoint_holds(env, tmp_path):
    _, paths = saves(env, tmp_path, "safetensors", 5, keep=1, is_async=True)
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    assert left == [paths[-1].name]
    last = paths[-1]
    assert all(p.stat().st_nlink == 1 for p in last.rglob("*") if p.is_file())  # nothing else holds its files
    assert stored_once([last]) == sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    assert manifest.verify_manifest(last).ok and manifest.read_manifest(last)["linked_bytes"] > 0


def test_off_by_default_one_file_per_rank(env, tmp_path):
    _, paths = saves(env, tmp_path, "safetensors", 2, incremental=False)
    names = sorted(p.name for p in (paths[-1] / layout.MODEL_DIR).glob("*.safetensors"))
    assert names == [layout.model_shard_file(0, 1, 1)]
    assert "linked_bytes" not in manifest.read_manifest(paths[-1])


def test_a_failed_save_after_the_link_leaves_the_published_checkpoint_whole(env, tmp_path, monkeypatch):
    """The stable file is linked, then the save fails before it is sealed: the staging folder is dropped, the
    published checkpoint keeps every file and verifies, and the next save links from it again."""
    from automodel_ckpt.checkpoint.save import writer
    from automodel_ckpt.errors import CheckpointError

    state, ck = Frozen(), make(env, tmp_path, "safetensors")
    one = ck.save(state.states(), info(1))
    linked = []

    def fail(staging, *args, **kwargs):
        linked.extend(p for p in stable_files(staging) if p.stat().st_nlink > 1)
        raise CheckpointError("sealing failed")

    monkeypatch.setattr(writer.manifest, "seal", fail)
    with pytest.raises(CheckpointError):
        ck.save(state.states(), info(2))
    monkeypatch.undo()
    assert linked  # the link was made before the failure
    assert manifest.verify_manifest(one).ok
    two = ck.save(state.states(), info(3))
    ck.finalize()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(layout.STAGING_PREFIX)]  # the failed one removed
    assert [os.stat(p).st_ino for p in stable_files(two)] == [os.stat(p).st_ino for p in stable_files(one)]
    assert manifest.verify_manifest(two).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_model_with_nothing_frozen_loads_from_its_empty_stable_part(env, tmp_path, fmt):
    """Every rank writes both parts (the files every rank holds must match): a part may hold no tensor at all."""
    state = ckpt_state.State(hidden=16)
    state.step()
    ck = make(env, tmp_path, fmt)
    path = ck.save(state.states(), info(1))
    ck.finalize()
    if fmt == "safetensors":
        assert (path / layout.MODEL_DIR / layout.model_shard_file(0, 2, layout.INCREMENTAL_SHARDS)).is_file()
    fresh = ckpt_state.State(hidden=16, seed=5)
    fresh.step()
    make(env, tmp_path, fmt).load(fresh.states(), path)
    for k, v in state.snapshot().items():
        assert torch.equal(fresh.snapshot()[k], v), k


def test_a_prune_cut_short_never_takes_a_file_a_kept_checkpoint_links(env, tmp_path):
    """What a kill in the middle of a prune leaves: the pruned checkpoint hidden as ``.deleting-*`` with part of its
    files removed, among them the shard it shares with the kept one. The kept checkpoint still verifies and loads
    bit for bit, the next save links from it, and its prune removes the leftover."""
    state, ck = Frozen(), make(env, tmp_path, "safetensors")
    one = ck.save(state.states(), info(1))
    state.step()
    two = ck.save(state.states(), info(2))
    ck.finalize()
    hidden = tmp_path / layout.deleting_name(one.name)
    one.rename(hidden)  # the prune's first step, then a kill part-way through removing the files
    for shard in stable_files(hidden):
        shard.unlink()
    (hidden / layout.MANIFEST_FILE).unlink()
    assert manifest.verify_manifest(two).ok and all(p.stat().st_nlink == 1 for p in stable_files(two))
    fresh = Frozen(seed=2)
    fresh.step()
    make(env, tmp_path, "safetensors").load(fresh.states(), two)
    assert all(torch.equal(fresh.snapshot()[k], v) for k, v in state.snapshot().items())
    ck = make(env, tmp_path, "safetensors", keep=1)  # a new launch: its first save writes, its second links
    three = ck.save(state.states(), info(3))
    four = ck.save(state.states(), info(4))
    ck.finalize()
    assert not hidden.exists() and not two.exists() and not three.exists()
    assert manifest.verify_manifest(four).ok and manifest.read_manifest(four)["linked_bytes"] > 0


def test_inspect_shows_own_and_shared_bytes_and_the_cost_report_the_bytes_written(env, tmp_path):
    from automodel_ckpt.cli.inspect import inspect_dir, render_table
    from automodel_ckpt.tracking import cost_report, one_line, render_cost, summarize

    _, paths = saves(env, tmp_path, "safetensors", 3)
    report = inspect_dir(tmp_path)
    rows = {r["name"]: r for r in report["checkpoints"]}
    for path in paths:
        own, shared = shared_bytes(path)
        assert (rows[path.name]["own_bytes"], rows[path.name]["shared_bytes"]) == (own, shared) and shared > 0
    assert report["totals"]["stored_bytes"] == stored_once(paths) < report["totals"]["size_bytes"]
    table = render_table(report)
    assert "OWN / SHARED" in table and "on disk (files shared by hard link stored once)" in table
    full = manifest.read_manifest(paths[0])["total_bytes"]
    written = full - manifest.read_manifest(paths[1])["linked_bytes"]
    records = [{"event": "start", "time": 0.0, "step": 0},
               *({"event": "checkpoint", "time": float(i), "step": i, "blocked_s": 0.1, "bytes": full,
                  "written_bytes": w} for i, w in ((1, full), (2, written), (3, written))),
               {"event": "end", "time": 4.0, "step": 3, "status": "complete", "wall_s": 4.0, "blocked_s": 0.3}]
    report = cost_report(summarize(records))
    share = 100 * (full + 2 * written) / 3 / full
    assert f"per checkpoint, {share:.1f}% of a full save" in one_line(report), one_line(report)
    assert f"= {share:.1f}% of a full save (the rest hard-linked" in render_cost(report)


def test_a_checkpoint_written_without_the_option_resumes_with_it(env, tmp_path):
    state, paths = saves(env, tmp_path, "safetensors", 1, incremental=False)
    fresh = Frozen(seed=4)
    ck = make(env, tmp_path, "safetensors")
    ck.load(fresh.states(), paths[0])
    assert all(torch.equal(fresh.snapshot()[k], v) for k, v in state.snapshot().items())
    fresh.step()
    two = ck.save(fresh.states(), info(2))
    ck.finalize()
    assert stable_files(two) and manifest.verify_manifest(two).ok
    again = Frozen(seed=6)
    make(env, tmp_path, "safetensors").load(again.states(), two)
    assert all(torch.equal(again.snapshot()[k], v) for k, v in fresh.snapshot().items())


def test_the_first_save_after_a_resume_links_the_files_whose_bytes_read_back_the_same(env, tmp_path):
    """A new launch trusts no inode of the previous one: it reads the resumed checkpoint's stable file back and links
    it only when those bytes hash the same as its own; a file damaged since is written afresh, never linked."""
    state, paths = saves(env, tmp_path, "safetensors", 1)
    resumed = Frozen(seed=7)
    ck = make(env, tmp_path, "safetensors")
    assert ck.resume(resumed.states()).path == paths[0] and ck.stats.resumed_from == paths[0].name
    two = ck.save(resumed.states(), info(2))
    ck.finalize()
    assert [os.stat(p).st_ino for p in stable_files(two)] == [os.stat(p).st_ino for p in stable_files(paths[0])]
    assert manifest.verify_manifest(two).ok and manifest.read_manifest(two)["linked_bytes"] > 0
    shard = stable_files(two)[0]
    data = bytearray(shard.read_bytes())  # damage the stored copy (every name of it) after the fact
    data[-1] ^= 0xFF
    os.unlink(stable_files(paths[0])[0])
    shard.unlink()
    shard.write_bytes(bytes(data))
    again = Frozen(seed=8)
    ck = make(env, tmp_path, "safetensors", incremental=True)
    ck._writer.resumed_from = two.name  # as a resume of ``two`` would set it (its load would refuse the damage)
    again.model.load_state_dict(resumed.model.state_dict())
    three = ck.save(again.states(), info(3))
    ck.finalize()
    assert os.stat(stable_files(three)[0]).st_ino != os.stat(shard).st_ino  # written, not linked
    assert manifest.verify_manifest(three).ok and "linked_bytes" not in manifest.read_manifest(three)
