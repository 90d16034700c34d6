"""Preference tuning end to end (recipes/tiny_llama_dpo.yaml, real `ckpt-train` launches, gloo).

Shared runs (module scope), 8 steps of 16 pairs, a checkpoint every 3 steps:

* ``synced``: 2 processes, the reference mixed toward the policy every 2 steps (``dpo.sync_ref_model``): straight,
  and with ``checkpoint.incremental`` and a checkpoint at every step, killed (SIGKILL of the whole job) once it
  starts its step-5 save, then rerun;
* ``world``: 1 process restored from the straight run's step-3 checkpoint (policy, optimizer and synced reference
  resharded from 2 ranks to 1);
* ``lora``: 2 processes (a replicated model, whose first forward is the reference's, adapters disabled), LoRA
  with precomputed reference log-probs: straight, and stopped at step 3 then rerun;
* ``frozen``: 1 process, full fine-tune with the live frozen reference (never saved): stopped at step 3 then rerun;
* ``s3``: as ``frozen``, its checkpoints on S3 (SeaweedFS), rerun from an empty staging folder; and with precomputed
  reference log-probs, which the rerun reads back from the bucket;
* ``local_tier``: as ``synced`` with node-local steps every 2 steps, every rank killed once the local step 4 is
  committed (the durable tier holds step 3), then rerun: it resumes from the node-local tier.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from automodel_ckpt.ondisk import catalog, layout, manifest
from tests.integration.browser import needs_chromium, report_shows
from tests.integration.harness import CKPT_TRAIN, QUIET, REPO, ckpt_train, env_for, jsonl, kill_job, start_command

DPO_RECIPE = REPO / "recipes" / "tiny_llama_dpo.yaml"
SHORT = ("--dataset.num_samples", "600", "--validation_dataset.num_samples", "32", "--step_scheduler.global_batch_size",
         "16", "--step_scheduler.local_batch_size", "8", "--step_scheduler.ckpt_every_steps", "3",
         "--step_scheduler.val_every_steps", "3", "--checkpoint.save_consolidated", "false",
         "--training.log_sample_ids", "true")  # warmup (10 steps) spans every run: a stop at 3 keeps the rate
SYNC = ("--dpo.sync_ref_model", "true", "--dpo.ref_model_sync_steps", "2")
INCREMENTAL = ("--checkpoint.incremental", "true", "--step_scheduler.ckpt_every_steps", "1")  # 2 saves per sync
DIE_AFTER_LOCAL_STEP = "tests.integration.fast_recovery_recipes.DieAfterLocalStepDPORecipe"
COMPARED = ("loss", "reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dpo")


def _train(work: Path, assets: Path, run: str, steps: int, *extra: str, nproc: int = 1, recipe: Path = DPO_RECIPE,
           check: bool = True, env: dict[str, str] | None = None):
    return ckpt_train(work, assets, *SHORT, "--checkpoint.checkpoint_dir", run, "--step_scheduler.max_steps",
                      str(steps), *extra, nproc=nproc, recipe=recipe, check=check, env=env)


def _rows(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "training.jsonl")


def _numbers(run_dir: Path) -> list[tuple]:
    return [tuple(r[k] for k in COMPARED) for r in _rows(run_dir)]


@cache
def _synced_straight(work: Path, assets: Path) -> Path:
    _train(work, assets, "synced", 8, *SYNC, nproc=2)
    return work / "synced"


@cache
def _synced_killed(work: Path, assets: Path) -> tuple[Path, str]:
    """Killed once rank 0 says it saves step 5 (inside or just after that save), then rerun to the end."""
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(DPO_RECIPE), *QUIET, *SHORT, *SYNC, *INCREMENTAL,
           "--checkpoint.checkpoint_dir", "killed", "--step_scheduler.max_steps", "8"]
    job = start_command(cmd, cwd=work, env=env_for(assets), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in job.stdout:
        seen.append(line)
        if "Saving checkpoint to killed/epoch_0_step_5" in line:
            break
    kill_job(job)
    assert any("epoch_0_step_5" in line for line in seen), "".join(seen)[-3000:]
    rerun = _train(work, assets, "killed", 8, *SYNC, *INCREMENTAL, nproc=2)
    return work / "killed", rerun.stdout


@cache
def _resharded(work: Path, assets: Path) -> tuple[Path, str]:
    source = _synced_straight(work, assets) / "epoch_0_step_3"
    result = _train(work, assets, "world", 8, *SYNC, "--checkpoint.restore_from", str(source), nproc=1)
    return work / "world", result.stdout


@cache
def _local_tier(work: Path, assets: Path) -> tuple[Path, str]:
    local = ("--checkpoint.local.every_steps", "2", "--checkpoint.local.dir", str(work / "node_local"))
    killed = _train(work, assets, "local_tier", 8, *SYNC, *local, "--recipe", DIE_AFTER_LOCAL_STEP, nproc=2,
                    check=False, env={"DIE_AFTER_LOCAL_STEP": "4", "PYTHONPATH": str(REPO)})
    assert killed.returncode != 0 and (work / "node_local" / "epoch_0_step_4").is_dir(), killed.output[-3000:]
    assert sorted(p.name for p in (work / "local_tier").glob("epoch_*")) == ["epoch_0_step_3"]
    return work / "local_tier", _train(work, assets, "local_tier", 8, *SYNC, *local, nproc=2).stdout


def _lora_recipe(work: Path) -> Path:
    path = work / "lora_dpo.yaml"
    if not path.exists():
        cfg = yaml.safe_load(DPO_RECIPE.read_text())
        cfg["peft"] = yaml.safe_load((REPO / "recipes" / "tiny_llama_peft.yaml").read_text())["peft"]
        path.write_text(yaml.safe_dump(cfg))
    return path


@cache
def _lora_runs(work: Path, assets: Path) -> dict[str, object]:
    recipe, extra = _lora_recipe(work), ("--dpo.precompute_ref_log_probs", "true")
    straight = _train(work, assets, "lora", 6, *extra, recipe=recipe, nproc=2)
    first = _train(work, assets, "lora_resumed", 3, *extra, recipe=recipe, nproc=2)
    second = _train(work, assets, "lora_resumed", 6, *extra, recipe=recipe, nproc=2)
    return {"straight": straight.stdout, "first": first.stdout, "second": second.stdout}


@cache
def _frozen_runs(work: Path, assets: Path) -> tuple[str, str]:
    _train(work, assets, "frozen", 6)
    first = _train(work, assets, "frozen_resumed", 3).stdout
    return first, _train(work, assets, "frozen_resumed", 6).stdout


# ------------------------------------------------------------------------------------------ tests


def test_a_killed_run_with_a_synced_reference_resumes_bitwise(work, assets):
    straight = _synced_straight(work, assets)
    killed, rerun = _synced_killed(work, assets)
    assert "Loading checkpoint from killed/epoch_0_step_" in rerun
    assert "Reference model: restored from the checkpoint" in rerun  # synced at step 2: state from then on
    assert len(_rows(straight)) == 8
    assert _numbers(killed) == _numbers(straight)  # bitwise: the same floats
    validated = jsonl(straight / "validation.jsonl")  # at its saves (every 3 steps); the killed run's: every step
    steps = {r["step"] for r in validated}
    assert [r for r in jsonl(killed / "validation.jsonl") if r["step"] in steps] == validated
    for step in (3, 6):  # the reference is state once synced: saved sharded beside the policy
        assert (straight / f"epoch_0_step_{step}" / "ref_model").is_dir()

    def reference(step: int) -> set[int]:  # the inodes of its shards (each rank's, all in the stable part)
        folder = killed / f"epoch_0_step_{step}" / "ref_model"
        return {(folder / layout.model_shard_file(r, 2, layout.INCREMENTAL_SHARDS)).stat().st_ino for r in (0, 1)}

    # written once per sync (steps 2, 4, 6, 8), linked by the save after it: step 5's by the rerun's first save from
    # the checkpoint it resumed from (read back and hashed), when the kill left step 4 the newest
    assert [c.name for c in catalog.scan_checkpoints(killed)] == [f"epoch_0_step_{s}" for s in range(1, 9)]
    assert not (killed / "epoch_0_step_1" / "ref_model").exists()  # saved from its first sync on
    for step in (3, 5, 7):
        assert reference(step) == reference(step - 1), step
    for step in (4, 6, 8):
        assert not reference(step) & reference(step - 1), step
    assert all(manifest.verify_manifest(c.path).ok for c in catalog.scan_checkpoints(killed))


@needs_chromium
def test_the_report_of_the_killed_and_resumed_run_shows_the_dpo_panel_in_a_browser(work, assets, tmp_path):
    killed, _ = _synced_killed(work, assets)
    report_shows(killed, tmp_path, "DPO", "reward margin", "reward accuracy", "reward_chosen", "epoch_0_step_8",
                 "launches:")


def test_a_synced_reference_resumes_bitwise_from_the_node_local_tier(work, assets):
    straight = _synced_straight(work, assets)
    run, rerun = _local_tier(work, assets)
    assert "Resumed from the node-local tier: epoch_0_step_4 (newer than the durable tier's epoch_0_step_3)" in rerun
    assert "Reference model: restored from the checkpoint (synced 2 time(s), last at step 4)" in rerun
    assert _numbers(run) == _numbers(straight)  # bitwise
    assert jsonl(run / "validation.jsonl") == jsonl(straight / "validation.jsonl")


def test_counters_are_in_the_checkpoint_and_inspect_shows_them(work, assets):
    straight = _synced_straight(work, assets)
    meta = yaml.safe_load((straight / "epoch_0_step_6" / "metadata.json").read_text())
    assert meta["extra"]["counters"] == {"dpo_step": 6, "consumed_pairs": 96, "ref_syncs": 3, "last_sync_step": 6}
    shown = subprocess.run([CKPT_TRAIN, "inspect", str(straight)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "epoch_0_step_3: dpo_step 3, consumed_pairs 48, ref_syncs 1, last_sync_step 2" in shown.stdout


def test_two_ranks_to_one_resumes_on_the_same_pairs_within_1e_5(work, assets):
    straight = _rows(_synced_straight(work, assets))
    world, out = _resharded(work, assets)
    resumed = _rows(world)
    assert "Reference model: restored from the checkpoint (synced 1 time(s), last at step 2)" in out
    assert [r["step"] for r in resumed] == [4, 5, 6, 7, 8]
    for a, b in zip(straight[3:], resumed):
        assert a["sample_ids"] == b["sample_ids"]  # the same pairs in the same steps
        for key in COMPARED:
            assert abs(a[key] - b[key]) < 1e-5, (a["step"], key, a[key], b[key])


def test_lora_with_precomputed_reference_log_probs_resumes_bitwise_and_reads_them_back(work, assets):
    runs = _lora_runs(work, assets)
    assert "Reference log-probs: computed for" in runs["first"]
    assert "Reference log-probs: read from lora_resumed/ref_log_probs/" in runs["second"]
    assert _numbers(work / "lora_resumed") == _numbers(work / "lora")
    stored = list((work / "lora_resumed" / "ref_log_probs").glob("*.pt"))
    assert len(stored) == 1 and stored[0].name == next((work / "lora" / "ref_log_probs").glob("*.pt")).name
    assert not (work / "lora" / "epoch_0_step_6" / "ref_model").exists()  # LoRA: no second copy


def test_a_frozen_reference_is_never_saved_and_is_rebuilt_and_checked_on_resume(work, assets):
    first, second = _frozen_runs(work, assets)
    line = "Reference model: a frozen copy of the starting weights (fingerprint "
    fingerprint = first.split(line, 1)[1].split(";", 1)[0]
    assert "Loading checkpoint from frozen_resumed/epoch_0_step_3" in second
    assert f"{line}{fingerprint};" in second  # rebuilt from the base, and the same as the run recorded
    assert _numbers(work / "frozen_resumed") == _numbers(work / "frozen")
    assert not any((work / "frozen").glob("epoch_*/ref_model"))


def test_a_run_on_object_storage_resumes_bitwise_from_a_fresh_staging_folder(work, assets, seaweed):
    """Checkpoints on S3, stopped at step 3 and rerun to step 6 from an empty staging folder (another machine):
    resumed from the bucket, the reference rebuilt and checked, the same numbers as the local run."""
    first, _ = _frozen_runs(work, assets)
    bucket = seaweed.new_bucket()
    url, env = f"s3://{bucket}/run", seaweed.env(XDG_CACHE_HOME=str(work / "s3_cache"))
    for steps, staging in ((3, "stage1"), (6, "stage2")):
        out = _train(work, assets, url, steps, "--checkpoint.staging_dir", str(work / staging), env=env).stdout
    assert f"Loading checkpoint from {url}/epoch_0_step_3" in out
    fingerprint = first.split("(fingerprint ", 1)[1].split(";", 1)[0]
    assert f"Reference model: a frozen copy of the starting weights (fingerprint {fingerprint};" in out
    rows = [json.loads(line) for line in seaweed.filesystem().cat(f"{bucket}/run/training.jsonl").decode().splitlines()
            if line]
    assert [tuple(r[k] for k in COMPARED) for r in rows] == _numbers(work / "frozen")
    assert seaweed.filesystem().exists(f"{bucket}/run/epoch_0_step_6/dpo.pt")


def test_precomputed_log_probs_on_object_storage_are_read_back_on_another_machine(work, assets, seaweed):
    """Precomputed reference log-probs of a run on S3 are stored in the bucket with its checkpoints: a rerun from an
    empty staging folder (another machine) reads them back instead of computing them again."""
    bucket = seaweed.new_bucket()
    url, env = f"s3://{bucket}/run", seaweed.env(XDG_CACHE_HOME=str(work / "s3_cache"))
    runs = [_train(work, assets, url, steps, "--dpo.precompute_ref_log_probs", "true", "--checkpoint.staging_dir",
                   str(work / staging), env=env).stdout for steps, staging in ((3, "lp_stage1"), (6, "lp_stage2"))]
    assert "Reference log-probs: computed for" in runs[0]
    assert "Reference log-probs: read from" in runs[1] and "computed for" not in runs[1]
    assert len(seaweed.filesystem().glob(f"{bucket}/run/ref_log_probs/*.pt")) == 1
    assert f"Loading checkpoint from {url}/epoch_0_step_3" in runs[1]


def test_a_reference_whose_base_changed_is_refused_in_one_line(work, assets):
    """Same architecture, other weights: the run's fingerprint (shapes) agrees, the reference's does not."""
    from safetensors.torch import load_file, save_file

    _frozen_runs(work, assets)
    other = work / "other_base"
    shutil.copytree(assets / "tiny_llama_base", other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    shutil.copytree(work / "frozen_resumed", work / "mismatch", symlinks=True)
    result = _train(work, assets, "mismatch", 8, "--model.pretrained_model_name_or_path", str(other), check=False)
    assert result.returncode != 0
    assert "the reference model does not match this run's" in result.output
    assert "Traceback" not in result.stderr
