"""Checkpoints on a real S3 server (SeaweedFS on loopback): save, resume bitwise, the commit protocol under SIGKILL,
retention, the verbs on s3:// URLs, and bad input caught before training.

One server for the session (``seaweed``), one bucket per test. Every run uses the standard AWS environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``) as a user would.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.harness import (CKPT_TRAIN, QUIET, RECIPE, ckpt_train, env_for, jsonl, kill_job, run_command,
                                       start_command)
from tests.integration.seaweed import ACCESS_KEY, SECRET_KEY

STEPS = ("--step_scheduler.max_steps", "8", "--step_scheduler.ckpt_every_steps", "2",
         "--step_scheduler.val_every_steps", "2", "--data.val_size", "64", "--checkpoint.save_consolidated", "false")


def s3_args(url: str, staging: Path, *more: str) -> tuple[str, ...]:
    return (*STEPS, "--checkpoint.checkpoint_dir", url, "--checkpoint.staging_dir", str(staging), *more)


def committed(fs, root: str) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)
            if fs.exists(f"{p}/manifest.json")} if fs.exists(root) else set()


def has_objects(fs, prefix: str) -> bool:
    """Whether any object is below ``prefix`` (SeaweedFS keeps empty folder placeholders: those do not count)."""
    return any(info.get("type") != "directory" for info in fs.find(prefix, detail=True).values())


def prefixes_with_objects(fs, root: str) -> set[str]:
    """The checkpoint-level prefixes below ``root`` that hold objects (committed or not)."""
    return {e["name"].rsplit("/", 1)[-1] for e in fs.ls(root, detail=True)
            if e["type"] == "directory" and has_objects(fs, e["name"])}


def s3_losses(fs, root: str) -> list[float]:
    return [json.loads(line)["loss"] for line in fs.cat(f"{root}/training.jsonl").decode().splitlines() if line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> list[float]:
    """Losses of an uninterrupted local 2-process run of the same schedule."""
    run = tmp_path_factory.mktemp("s3_reference")
    ckpt_train(run, assets, *STEPS, "--checkpoint.checkpoint_dir", str(run / "ckpt"), nproc=2)
    return [r["loss"] for r in jsonl(run / "ckpt" / "training.jsonl")]


@pytest.mark.parametrize("fmt,is_async", [("safetensors", "false"), ("torch_save", "true")])
def test_s3_run_resumes_bitwise_and_retention_keeps_resumed_from_and_pointer_targets(
        fmt, is_async, seaweed, assets, reference, tmp_path):
    """Both formats (torch_save with async saves), 2 processes: save to S3, rerun from an empty staging folder."""
    bucket = seaweed.new_bucket()
    url, fs, env = f"s3://{bucket}/run", seaweed.filesystem(), seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    ckpt_train(tmp_path, assets, *s3_args(url, tmp_path / "stage1", "--checkpoint.model_save_format", fmt,
                                          "--checkpoint.is_async", is_async, "--step_scheduler.max_steps", "4"),
               nproc=2, env=env)
    assert not (tmp_path / "s3:").exists()  # a URL never becomes a local folder
    assert committed(fs, f"{bucket}/run") >= {"epoch_0_step_2", "epoch_0_step_4"}
    # rerun from a fresh machine (a new staging folder): it resumes from S3; mode max makes LOWEST_VAL follow the
    # highest validation loss (an early checkpoint), so retention must keep three kinds of checkpoints
    second = ckpt_train(tmp_path, assets, *s3_args(url, tmp_path / "stage2", "--checkpoint.model_save_format", fmt,
                                                   "--checkpoint.is_async", is_async,
                                                   "--checkpoint.max_recent_checkpoints", "1",
                                                   "--checkpoint.mode", "max"),
                        nproc=2, env=env)
    assert f"Loading checkpoint from {url}/epoch_0_step_4" in second.output  # what was configured, not the mirror
    assert s3_losses(fs, f"{bucket}/run") == reference  # bitwise: the resumed run equals the uninterrupted one
    best = fs.cat(f"{bucket}/run/LOWEST_VAL").decode().strip()
    assert fs.cat(f"{bucket}/run/LATEST").decode().strip() == "epoch_0_step_8"
    # kept: the newest (LATEST), the LOWEST_VAL target, the checkpoint resumed from; nothing else
    assert committed(fs, f"{bucket}/run") == {"epoch_0_step_8", "epoch_0_step_4", best}


def test_verbs_and_restore_from_on_s3_and_the_export_loads_in_transformers(seaweed, assets, tmp_path):
    bucket = seaweed.new_bucket()
    url, fs, env = f"s3://{bucket}/run", seaweed.filesystem(), seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    # the first run has its credentials from storage_options only, the secret through ${oc.env:...}: no copy of
    # the config (config.yaml here and on the store, metadata.json) may hold them
    only_options = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    ckpt_train(tmp_path, assets, *s3_args(url, tmp_path / "stage", "--step_scheduler.max_steps", "2",
                                          "--checkpoint.storage_options.key", ACCESS_KEY,
                                          "--checkpoint.storage_options.secret", "${oc.env:CKPT_TEST_S3_SECRET}"),
               nproc=2, env={**only_options, "CKPT_TEST_S3_SECRET": SECRET_KEY})
    stored = {p: fs.cat(p).decode() for p in fs.find(f"{bucket}/run") if p.endswith(("config.yaml", ".json"))}
    local = {str(p): p.read_text() for p in (tmp_path / "stage").rglob("*") if p.name == "config.yaml"}
    assert any(p.endswith("epoch_0_step_2/config.yaml") for p in stored) and local
    for path, text in {**stored, **local}.items():
        assert SECRET_KEY not in text and f"key: {ACCESS_KEY}" not in text, path
        if path.endswith("config.yaml"):
            assert yaml.safe_load(text)["checkpoint"]["storage_options"] == {"key": "<redacted>",
                                                                             "secret": "<redacted>"}, path

    def verb(*args: str) -> subprocess.CompletedProcess:
        return run_command([CKPT_TRAIN, *args], cwd=tmp_path, env=env_for(assets, env), timeout=300)

    inspected = verb("inspect", url, "--json")
    assert inspected.returncode == 0, inspected.stderr
    rows = json.loads(inspected.stdout)["checkpoints"]
    assert [r["name"] for r in rows] == ["epoch_0_step_2"] and rows[0]["size_bytes"] > 1_000_000
    verified = verb("verify", url)
    assert verified.returncode == 0 and "verify: OK (1 checkpoint(s))" in verified.stdout, verified.stdout
    exported = verb("consolidate", f"{url}/LATEST", "--out", f"{url}-hf", "--no-progress")  # a pointer resolves
    assert exported.returncode == 0, exported.stderr
    local = tmp_path / "hf"
    fs.get(f"{bucket}/run-hf/", str(local), recursive=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local)
    assert sum(p.numel() for p in model.parameters()) > 0
    plotted = verb("plot", url, "--out", str(tmp_path / "loss.png"))
    assert plotted.returncode == 0 and (tmp_path / "loss.png").stat().st_size > 0, plotted.stderr
    # restore_from a checkpoint's URL, at another world size (2 -> 1), into another run folder on the store
    second = ckpt_train(tmp_path, assets, *s3_args(f"{url}2", tmp_path / "stage2", "--step_scheduler.max_steps", "3",
                                                   "--checkpoint.restore_from", f"{url}/epoch_0_step_2"),
                        nproc=1, env=env)
    assert "Resuming at world size 1 (checkpoint written by 2)" in second.output
    assert committed(fs, f"{bucket}/run2") == {"epoch_0_step_3"}
    fs.pipe(f"{bucket}/run/epoch_0_step_2/rng/rng_dp_rank_1.pt", b"garbage")  # damage one object
    damaged = verb("verify", "--sizes-only", f"{url}/epoch_0_step_2")
    assert damaged.returncode == 1 and "size mismatch" in damaged.stdout, damaged.stdout


@pytest.mark.parametrize("moment", ["save_starts", "upload_started"])
def test_sigkill_during_upload_never_selects_the_partial_checkpoint(moment, seaweed, assets, reference, tmp_path):
    """Kill the job as epoch_0_step_4's save starts (the local write), or as soon as its first object is on the
    store (the upload); whatever was uploaded is never listed, the rerun resumes from a committed checkpoint, ends
    bitwise equal to an uninterrupted run, and no leftover remains (gc, or the rerun's next save, removed it)."""
    bucket = seaweed.new_bucket()
    url, fs, env = f"s3://{bucket}/run", seaweed.filesystem(), seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET,
           *s3_args(url, tmp_path / "stage1", "--checkpoint.model_save_format", "torch_save")]
    proc = start_command(cmd, cwd=tmp_path, env=env_for(assets, env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # rank 0 prints this line as the save starts, then writes, uploads and commits
            if "Saving checkpoint to" in line and "epoch_0_step_4" in line:
                break
        else:
            pytest.fail("the run ended before saving epoch_0_step_4")
        deadline = time.monotonic() + 120
        while moment == "upload_started" and not has_objects(fs, f"{bucket}/run/epoch_0_step_4"):
            assert time.monotonic() < deadline and proc.poll() is None, "no upload of epoch_0_step_4 seen"
    finally:
        kill_job(proc)
    root = f"{bucket}/run"
    seen = committed(fs, root)
    assert "epoch_0_step_2" in seen  # committed before the kill
    latest = fs.cat(f"{root}/LATEST").decode().strip()
    assert latest in seen  # LATEST never names a checkpoint without its commit object
    listed = run_command([CKPT_TRAIN, "inspect", url, "--json"], env=env_for(assets, env), timeout=300)
    assert {r["name"] for r in json.loads(listed.stdout)["checkpoints"]} == seen
    leftovers = prefixes_with_objects(fs, root) - seen
    if moment == "upload_started":
        assert leftovers or "epoch_0_step_4" in seen
    if leftovers and moment == "upload_started":  # gc removes what the killed save left (nothing else runs)
        gc = run_command([CKPT_TRAIN, "gc", url, "--min-age-minutes", "0"], env=env_for(assets, env), timeout=300)
        assert gc.returncode == 0 and f"gc: {len(leftovers)} leftover(s) deleted" in gc.stdout, gc.stdout + gc.stderr
        assert not any(has_objects(fs, f"{root}/{name}") for name in leftovers)
    rerun = ckpt_train(tmp_path, assets, *s3_args(url, tmp_path / "stage2", "--checkpoint.model_save_format",
                                                  "torch_save"), nproc=2, env=env)
    resumed = max(seen, key=lambda n: int(n.rsplit("_", 1)[1]))
    assert f"Loading checkpoint from {url}/{resumed}" in rerun.output
    assert s3_losses(fs, root) == reference
    # no leftover prefix: removed by gc or by the rerun's next save
    assert prefixes_with_objects(fs, root) == committed(fs, root)


@pytest.mark.parametrize("case", ["unreachable", "missing_bucket", "wrong_credentials", "unknown_scheme",
                                  "missing_backend"])
def test_bad_object_store_input_is_one_line_before_training(case, seaweed, assets, tmp_path):
    bucket = seaweed.new_bucket()
    env = seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    url = f"s3://{bucket}/run"
    expect = {"unreachable": "cannot reach the object store", "missing_bucket": "does not exist",
              "wrong_credentials": "denied", "unknown_scheme": "unknown storage scheme",
              "missing_backend": "pip install gcsfs"}[case]
    if case == "unreachable":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # discard port: nothing listens
    elif case == "missing_bucket":
        url = "s3://no-such-bucket-here/run"
    elif case == "wrong_credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
    elif case == "unknown_scheme":
        url = "foo://bucket/run"
    else:
        url = "gs://bucket/run"
    result = ckpt_train(tmp_path, assets, "--checkpoint.checkpoint_dir", url, "--step_scheduler.max_steps", "2",
                        nproc=1, env=env, check=False)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and expect in errors[0], result.output[-2000:]
    assert "Traceback" not in result.output and "step 1" not in result.output
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "foo:").exists() and not (tmp_path / "gs:").exists()
