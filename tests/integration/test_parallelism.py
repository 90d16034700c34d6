"""Resume across parallelism strategies (dp 4 → dp 2 × pp 2 → pp 4 → tp 2 → 1 process → dp 2 × tp 2 + SP →
HSDP 2 × 2, as a straight dp 4 run; pp 2 × tp 2 beside it; the pipeline's three schedules), both formats,
bitwise resume on an unchanged pipeline mesh, async saves and a SIGKILL on a 2-D mesh, the model and optimizer
tensors after a resume on another mesh, sequence parallelism on several families, and the export of a dp 2 × tp 2
checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.family_bases import folder_weights
from tests.integration import forked_ranks
from tests.integration.harness import ckpt_train, env_for, jsonl, launch_failure

BATCH = ("--dataset.num_samples", "2000", "--step_scheduler.global_batch_size", "32", "--step_scheduler.local_batch_size", "8",
         "--data.val_size", "16", "--training.log_sample_ids", "true", "--checkpoint.save_consolidated", "false",
         "--step_scheduler.ckpt_every_steps", "2")
DP4 = ()
DP2_TP2 = ("--distributed.tp_size", "2")
SP = ("--distributed.sequence_parallel", "true")
TP2 = DP2_TP2  # on 2 processes
HSDP = ("--distributed.dp_replicate_size", "2")
PP2_DP2 = ("--distributed.pp_size", "2")  # 1f1b, 2 microbatches
PP4 = ("--distributed.pp_size", "4")  # on 4 processes: one decoder layer per stage
GPIPE = ("--distributed.pp_schedule", "gpipe")
# two stages per rank (decoder layers 0 and 2 on the first rank, 1 and 3 on the second)
INTERLEAVED = ("--distributed.pp_schedule", "interleaved_1f1b", "--distributed.pp_microbatches", "4")
EVERY_STEP = ("--step_scheduler.ckpt_every_steps", "1")
DCP_ASYNC = ("--checkpoint.model_save_format", "torch_save", "--checkpoint.is_async", "true")
LEGS = [  # (processes, mesh keys, what the resume line calls the mesh)
    (4, DP4, "dp 4"),
    (4, PP2_DP2 + INTERLEAVED + EVERY_STEP, "dp 2 × pp 2"),  # step 3 saved too: a bitwise resume starts there
    (4, PP4 + GPIPE, "pp 4"),
    (2, TP2, "tp 2"),
    (1, DP4, "dp 1"),
    # sequence parallelism: the checkpoint is the same (a dp 2 × tp 2 one), written in the background in DCP files
    (4, DP2_TP2 + SP + DCP_ASYNC, "dp 2 × tp 2 + SP"),
    (4, HSDP, "HSDP 2 × 2"),  # reads the DCP files, writes safetensors shards
]


def _records(run_dir):
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


def _leg(tmp_path, assets, run: str, step: int, nproc: int, keys: tuple[str, ...], *extra: str):
    return ckpt_train(tmp_path, assets, *BATCH, *keys, *extra, "--checkpoint.checkpoint_dir", run,
                      "--step_scheduler.max_steps", str(step), nproc=nproc)


def _assert_same_steps(run_dir: Path, straight: Path, steps) -> None:
    got, want = _records(run_dir), _records(straight)
    for step in steps:
        assert got[step]["sample_ids"] == want[step]["sample_ids"], step  # the same samples, in the same order
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step


def _killed_inside_a_save(tmp_path, assets, run: str, step: int, nproc: int, keys: tuple[str, ...],
                          *extra: str) -> None:
    """Start a leg in a new checkpoint folder and SIGKILL the whole job while its first save is being written; the
    folder stays sound (every complete checkpoint matches its manifest, LATEST names a complete one, the
    half-written one is staging, never selected).

    The kill lands inside the save by construction: as soon as the save's staging folder exists the whole job is
    stopped (SIGSTOP), and killed only if the staging folder is still there once nothing runs. A save that
    published before the job stopped is a miss: the folder is removed and the leg started again.
    """
    from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, kill_job, start_command, stop_job
    from tests.integration.test_kill_fault import check_dir, saves_in_progress

    root = tmp_path / run
    assert not root.exists()
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(nproc), str(RECIPE), *QUIET, *BATCH, *keys, *extra,
           "--checkpoint.checkpoint_dir", run, "--step_scheduler.max_steps", str(step)]
    for attempt in range(3):
        log, started = tmp_path / f"killed_{run}_{step}_{attempt}.log", time.time()
        with open(log, "w") as out:
            proc = start_command(cmd, cwd=tmp_path, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.monotonic() + 300
        while not saves_in_progress(root, started) and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.002)
        stop_job(proc)
        in_save = saves_in_progress(root, started)
        kill_job(proc)
        if in_save:
            break
        shutil.rmtree(root, ignore_errors=True)  # the save published first: start the leg again
    assert in_save, log.read_text()[-2000:]  # the kill landed inside the save
    complete, failures, _ = check_dir(root, set())
    assert not failures and complete == set()  # the killed save is never selected


def test_resume_across_strategies_keeps_samples_and_losses(tmp_path, assets):
    """The straight dp 4 run is also the chain's first leg: the chain starts from its step-2 checkpoint. Beside the
    chain, from the same checkpoint: pp 2 × tp 2 in DCP files; and a resume on an unchanged pipeline mesh, from each
    format, gives the next step bit for bit. The pipeline legs run the three schedules, each giving the straight
    run's steps: interleaved_1f1b with two stages per rank (dp 2 × pp 2), gpipe (pp 4) and 1f1b (pp 2 × tp 2)."""
    total = 2 * len(LEGS)
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    _leg(tmp_path, assets, "straight", total, 4, DP4)
    start = ("--checkpoint.restore_from", str(straight / "epoch_0_step_2"))
    # a SIGKILL during a 2-D save first: nothing of it is selected, the rerun starts from the dp 4 checkpoint again
    _killed_inside_a_save(tmp_path, assets, "chain", 4, 4, DP2_TP2, *start)
    before, before_nproc = LEGS[0][2], LEGS[0][0]
    for i, (nproc, keys, name) in enumerate(LEGS[1:], start=1):
        out = _leg(tmp_path, assets, "chain", 2 * (i + 1), nproc, keys, *(start if i == 1 else ()))
        resized = f" (world size {before_nproc} -> {nproc})" if nproc != before_nproc else ""
        assert f"Resuming a {before} checkpoint on {name}{resized}: " in out.stdout
        meta = json.loads((chain / f"epoch_0_step_{2 * (i + 1)}" / "metadata.json").read_text())
        assert meta["world_size"] == nproc
        if name == "dp 2 × pp 2":
            assert ("Pipeline stage 1: decoder layers 1 and 3 (interleaved_1f1b, 4 microbatches, 2 stages per rank)"
                    in out.stdout)
        if name == "pp 4":
            assert "Pipeline stage 3: decoder layer 3 (gpipe, 4 microbatches)" in out.stdout
        before, before_nproc = name.removesuffix(" + SP"), nproc
    assert sorted(_records(chain)) == list(range(3, total + 1))
    _assert_same_steps(chain, straight, range(3, total + 1))
    # validation through the pipeline (dp 2 × pp 2 at step 4, pp 4 at step 6): the straight run's
    val, straight_val = ({r["step"]: r["val_loss"] for r in jsonl(run / "validation.jsonl")}
                         for run in (chain, straight))
    for step in (4, 6):
        assert val[step] == pytest.approx(straight_val[step], abs=1e-5), step
    # per-rank state is per data-parallel rank, written once whatever the stages: dp 2 × pp 2 and dp 2 × tp 2 wrote
    # two RNG files, pp 4 and tp 2 one
    for step, ranks in ((4, 2), (6, 1), (8, 1), (12, 2)):
        assert sorted(p.name for p in (chain / f"epoch_0_step_{step}" / "rng").iterdir()) == [
            f"rng_dp_rank_{r}.pt" for r in range(ranks)], step
    meshes = {4: {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2},
              6: {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 4},
              12: {"dp_replicate": 1, "dp_shard": 2, "tp": 2}}
    for step, mesh in meshes.items():
        assert json.loads((chain / f"epoch_0_step_{step}" / "metadata.json").read_text())["mesh"] == mesh, step
    assert (chain / "epoch_0_step_12" / "model" / ".metadata").is_file()  # the dp 2 × tp 2 leg's DCP files

    # HSDP writes each byte once: the replicas' shards are written by one rank each (DCP deduplicates them)
    def model_bytes(ckpt: Path) -> int:
        return sum(f.stat().st_size for f in (ckpt / "model").glob("shard-*.safetensors"))

    assert model_bytes(chain / f"epoch_0_step_{total}") == pytest.approx(
        model_bytes(straight / f"epoch_0_step_{total}"), rel=0.05)

    # pp 2 × tp 2 (the stages' projections split by the family's plan), in DCP files: the straight run's steps
    dcp = ("--checkpoint.model_save_format", "torch_save")
    out = _leg(tmp_path, assets, "pptp", 4, 4, PP2_DP2 + DP2_TP2 + EVERY_STEP, *dcp, *start)
    assert "Resuming a dp 4 checkpoint on pp 2 × tp 2: " in out.stdout
    assert "Pipeline stage 0: decoder layers 0-1 (1f1b, 2 microbatches)" in out.stdout
    assert (tmp_path / "pptp" / "epoch_0_step_4" / "model" / ".metadata").is_file()
    _assert_same_steps(tmp_path / "pptp", straight, range(3, 5))
    # an unchanged pipeline mesh from its own step-3 checkpoint: step 4 bit for bit, from DCP files and from
    # safetensors shards (this one saving in the other format, in the background)
    _leg(tmp_path, assets, "pptp_again", 4, 4, PP2_DP2 + DP2_TP2, *dcp,
         "--checkpoint.restore_from", str(tmp_path / "pptp" / "epoch_0_step_3"))
    _leg(tmp_path, assets, "chain_again", 4, 4, PP2_DP2 + INTERLEAVED, *DCP_ASYNC,
         "--checkpoint.restore_from", str(chain / "epoch_0_step_3"))
    for again, run in (("pptp_again", "pptp"), ("chain_again", "chain")):
        got, want = _records(tmp_path / again)[4], _records(tmp_path / run)[4]
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), again


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_model_and_optimizer_tensors_after_a_resume_on_another_mesh_are_those_saved(tmp_path, assets, fmt):
    """dp 4 → dp 2 × tp 2 → HSDP 2 × 2 (reshard_tensors.py): every parameter and AdamW state, gathered whole, bit
    for bit what the previous mesh saved."""
    done = forked_ranks.launch(4, Path(__file__).with_name("reshard_tensors.py"), str(tmp_path), fmt,
                               env=env_for(assets))
    assert done.returncode == 0, launch_failure(done)
    assert f"{fmt}: dp 4 -> dp 2 × tp 2: 84 tensors equal" in done.stdout
    assert f"{fmt}: dp 2 × tp 2 -> HSDP 2 × 2: 84 tensors equal" in done.stdout


def test_sequence_parallel_families_give_the_whole_model_gradients(assets):
    """Gemma (tied, scaled embeddings), Phi-3 (fused projections), Mixtral (whole experts), Qwen3-MoE (whole
    experts, per-head norms) on tp 2 + SP:
    sequence_parallel_families.py compares the loss and every gradient with the whole model's."""
    families = ["gemma", "phi3", "mixtral", "qwen3_moe"]
    done = forked_ranks.launch(2, Path(__file__).with_name("sequence_parallel_families.py"), *families,
                               env=env_for(assets))
    assert done.returncode == 0, launch_failure(done)
    for family in families:
        assert f"{family}: tp 2 + SP loss and" in done.stdout


def _tp_base(family: str, folder: Path) -> Path:
    """A bf16 base of ``family`` whose 4 heads and 2 key-value heads split over 2 tensor-parallel ranks."""
    from transformers import AutoModelForCausalLM

    from tests.family_bases import build_tokenizer, family_config

    config = family_config(family)
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=int(total * 0.55) + 1)  # two weight files and an index
    build_tokenizer().save_pretrained(folder)
    return folder


# qwen2: tied embeddings, q/k/v biases, sequence parallelism; qwen3_moe: fused experts (whole on each
# tensor-parallel rank), per-head norms
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_lr0_export_from_dp2_tp2_is_the_base(tmp_path, assets, family):
    """qwen2 and qwen3_moe export inline at the save; llama's checkpoint is exported afterwards by its
    consolidate.sh in one process and in two (not the 4 that wrote it), to the same bytes. qwen3_moe's first loss
    and gradient norm are also a dp 4 run's; its gradients under sequence parallelism are compared with the whole
    model's in test_sequence_parallel_families_give_the_whole_model_gradients."""
    base = _tp_base(family, tmp_path / f"{family}_base")
    inline = family != "llama"
    args = ("--model.pretrained_model_name_or_path", str(base), "--model.embedded", "null", "--optimizer.lr", "0",
            "--dataset.num_samples", "400", "--data.val_size", "16", "--step_scheduler.global_batch_size", "16",
            "--step_scheduler.local_batch_size", "4" if family == "qwen3_moe" else "8",
            "--step_scheduler.max_steps", "1")
    sp = SP if family == "qwen2" else ()  # the tied embedding (whole) and the head gather or cut the sequence
    ckpt_train(tmp_path, assets, *args, "--distributed.tp_size", "2", *sp,
               "--checkpoint.save_consolidated", "final" if inline else "false",
               "--checkpoint.checkpoint_dir", "run", nproc=4)
    if family == "qwen3_moe":
        ckpt_train(tmp_path, assets, *args, "--checkpoint.enabled", "false", "--checkpoint.checkpoint_dir", "dp4",
                   nproc=4)
        (dp,) = jsonl(tmp_path / "dp4" / "training.jsonl")
        (tp,) = jsonl(tmp_path / "run" / "training.jsonl")
        assert tp["loss"] == pytest.approx(dp["loss"], abs=1e-5)
        assert tp["grad_norm"] == pytest.approx(dp["grad_norm"], rel=1e-5)
    model_dir = tmp_path / "run" / "epoch_0_step_1" / "model"
    outputs = [model_dir / "consolidated"]
    if not inline:
        outputs.append(tmp_path / "two_processes")
        for nproc, out in zip((1, 2), outputs):
            done = subprocess.run(["bash", str(model_dir / "consolidate.sh"), "--out", str(out)], capture_output=True,
                                  text=True, timeout=600, env=env_for(assets, {"NPROC_PER_NODE": str(nproc)}))
            assert done.returncode == 0, done.stderr[-3000:]
    expected = folder_weights(base)
    for out in outputs:
        actual = folder_weights(out)
        assert sorted(actual) == sorted(expected)
        for name, (file, tensor) in expected.items():
            assert actual[name][0] == file and actual[name][1].dtype == tensor.dtype, (out.name, name)
            assert torch.equal(actual[name][1].view(torch.uint8), tensor.view(torch.uint8)), (out.name, name)
