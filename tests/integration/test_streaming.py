"""Streamed corpora end to end: a straight 2-rank run equals the chain 2 -> 3 with 2 workers (killed while saving) -> 1
-> tp 2, over 6 lanes, shuffle buffer on; a blend of three sources resumed at another world size; a corpus on S3, each
object read by one rank; a corrupt row and a changed corpus are one line each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from automodel_ckpt.ondisk.metadata import read_metadata
from tests.integration.harness import CKPT_TRAIN, REPO, ckpt_train, env_for, jsonl, run_command

KEYS = ("--step_scheduler.global_batch_size", "12", "--step_scheduler.local_batch_size", "2",
        "--data.seq_length", "32", "--data.shuffle_buffer", "50", "--step_scheduler.ckpt_every_steps", "3",
        "--training.log_sample_ids", "true", "--checkpoint.save_consolidated", "false", "--data.lanes", "6")


def _write_corpus(folder: Path, files: int, rows: int, tag: str) -> Path:
    folder.mkdir(parents=True)
    for f in range(files):
        with open(folder / f"{tag}-{f:02d}.jsonl", "w") as out:
            for r in range(rows):
                out.write(json.dumps({"text": f"{tag} {f} says {r * 7 % 90} plus {r % 13} is {r * 7 % 90 + r % 13}."})
                          + "\n")
    return folder


def _recipe(path: Path, dataset: dict, validation: dict | None) -> Path:
    cfg = OmegaConf.load(REPO / "recipes" / "tiny_llama_pretrain.yaml")
    cfg.dataset = dataset
    cfg.validation_dataset = validation
    OmegaConf.save(cfg, path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    train = _write_corpus(root / "train", 8, 40, "train")
    held = _write_corpus(root / "held", 1, 20, "held")
    target = "automodel_ckpt.data.stream.corpus.streamed_corpus"
    recipe = _recipe(root / "stream.yaml", {"_target_": target, "path": str(train / "*.jsonl")},
                     {"_target_": target, "path": str(held / "*.jsonl"), "max_sequences": 8})
    blend = _recipe(root / "blend.yaml", {"_target_": target, "sources": [
        {"path": str(_write_corpus(root / f"s{i}", 3, 30, f"src{i}") / "*.jsonl"), "weight": w}
        for i, w in enumerate((1, 2, 3))]}, None)
    return root, recipe, blend


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in jsonl(run_dir / "training.jsonl")}


@pytest.fixture(scope="module")
def straight(corpus, assets):
    root, recipe, _ = corpus
    ckpt_train(root, assets, *KEYS, "--step_scheduler.max_steps", "12", "--checkpoint.checkpoint_dir", "straight",
               nproc=2, recipe=recipe)
    return _records(root / "straight")


def test_resume_on_3_with_workers_then_1_then_tp2_sees_the_same_sequences(corpus, assets, straight, tmp_path):
    _, recipe, _ = corpus
    run = ("--checkpoint.checkpoint_dir", "chain")
    ckpt_train(tmp_path, assets, *KEYS, *run, "--step_scheduler.max_steps", "3", nproc=2, recipe=recipe)
    # 3 ranks of 2 workers each (one lane per worker) SIGKILLed while saving step 9: the resume starts at step 6
    killed = ckpt_train(tmp_path, assets, *KEYS, *run, "--step_scheduler.max_steps", "12", "--data.num_workers", "2",
                        "--recipe", "tests.integration.recipes_for_tests.CrashDuringSaveRecipe", nproc=3, recipe=recipe,
                        env={"CRASH_AT_STEP": "9", "PYTHONPATH": str(REPO)}, check=False)
    assert killed.returncode != 0 and max(_records(tmp_path / "chain")) >= 8
    assert "6 lanes over 8 units, this rank reads 2 (each lane read once), 2 workers per rank, 1 lanes per worker" \
        in killed.stdout
    for nproc, steps, extra in [(1, "9", ()), (2, "12", ("--distributed.tp_size", "2"))]:
        out = ckpt_train(tmp_path, assets, *KEYS, *run, "--step_scheduler.max_steps", steps, *extra, nproc=nproc,
                         recipe=recipe)
        assert "data position kept" in out.stdout
    got = _records(tmp_path / "chain")
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step]["sample_ids"] == straight[step]["sample_ids"], step  # the same sequences, in order
        assert len(set(got[step]["sample_ids"])) == 12
        assert got[step]["source_tokens"] == straight[step]["source_tokens"] == [step * 12 * 32]
        assert got[step]["data_wait_seconds"] >= 0
        if step <= 3:  # the same mesh: bitwise
            assert got[step]["loss"] == straight[step]["loss"]
        else:
            assert got[step]["loss"] == pytest.approx(straight[step]["loss"], abs=1e-5)
    position = tmp_path / "chain" / "epoch_0_step_12" / "dataloader" / "dataloader_dp_rank_0.pt"
    assert position.stat().st_size < 64 * 1024  # row references, not rows
    shown = run_command([CKPT_TRAIN, "inspect", str(tmp_path / "chain")], env=env_for(assets))
    assert "data position at epoch_0_step_12: 144 sequences; 6 lanes (this rank 6), position " in shown.stdout
    assert f"{12 * 12 * 32} tokens consumed" in shown.stdout


def _loader_ids(recipe: Path, assets: Path, steps: int, rank: int = 0, dp: int = 1,
                workers: int = 0) -> tuple[list[int], list[int]]:
    """The ids rank ``rank`` of ``dp`` trains on in ``steps`` steps, computed in this process as the training loader
    makes them (``build_streamed``), and the tokens per source it reports."""
    from types import SimpleNamespace

    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.data.stream.build import build_streamed
    from automodel_ckpt.models.build import build_tokenizer

    cfg = load_config(str(recipe), [*KEYS, "--data.num_workers", str(workers)], RecipeConfig)
    dims = SimpleNamespace(dp_rank=rank, dp_size=dp, sum_over_dp=lambda t: t)
    loader, _ = build_streamed(cfg, build_tokenizer(str(assets / "tiny_llama_base")), dims, log_ids=False)
    ids = [int(x) for _ in range(steps) for mb in loader.next_batch()[1] for x in mb.sample_ids.tolist()]
    return ids, loader.source_tokens


def test_a_blend_of_three_sources_resumes_with_its_per_source_counts(corpus, assets, tmp_path):
    root, _, blend = corpus
    ckpt_train(tmp_path, assets, *KEYS, "--step_scheduler.max_steps", "3", "--checkpoint.checkpoint_dir", "two",
               nproc=2, recipe=blend)
    ckpt_train(tmp_path, assets, *KEYS, "--step_scheduler.max_steps", "6", "--checkpoint.checkpoint_dir", "two",
               "--data.num_workers", "2", nproc=1, recipe=blend)
    ids, counts = _loader_ids(blend, assets, 6)  # what one rank computes straight through
    got = _records(tmp_path / "two")
    for step in range(1, 7):
        assert got[step]["sample_ids"] == ids[(step - 1) * 12:step * 12]
    assert got[6]["source_tokens"] == counts
    assert sum(counts) == 6 * 12 * 32 and counts[0] < counts[2]


def test_a_corrupt_row_and_a_changed_corpus_are_one_line_each(corpus, assets, tmp_path):
    root, _, _ = corpus
    copy = tmp_path / "train"
    shutil.copytree(root / "train", copy)
    target = "automodel_ckpt.data.stream.corpus.streamed_corpus"
    recipe = _recipe(tmp_path / "r.yaml", {"_target_": target, "path": str(copy / "*.jsonl")}, None)
    ckpt_train(tmp_path, assets, *KEYS, "--step_scheduler.max_steps", "3", "--checkpoint.checkpoint_dir", "c",
               nproc=1, recipe=recipe)
    with open(copy / "train-03.jsonl", "a") as f:
        f.write("{truncated\n")
    changed = ckpt_train(tmp_path, assets, *KEYS, "--step_scheduler.max_steps", "6", "--checkpoint.checkpoint_dir", "c",
                         nproc=1, recipe=recipe, check=False)
    assert changed.returncode != 0
    line = [x for x in changed.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "train-03.jsonl' changed since the checkpoint (size" in line[0], changed.stderr[-2000:]
    fresh = ckpt_train(tmp_path, assets, *KEYS, "--step_scheduler.max_steps", "30", "--checkpoint.checkpoint_dir", "d",
                       nproc=2, recipe=recipe, check=False)
    assert fresh.returncode != 0
    lines = fresh.stderr.splitlines()
    first = next(x for x in lines if x.startswith("error:"))
    assert "train-03.jsonl row 40: bad JSON" in first and "Traceback" not in fresh.stderr, fresh.stderr[-2000:]
    errors = [x.split("] ", 1)[-1] for x in lines if x.startswith(("error:", "[rank"))]
    assert len(errors) == len(set(errors)), fresh.stderr[-2000:]  # every rank stops there: its line said once


def test_a_corpus_on_s3_is_read_and_resumed_with_the_local_runs_sequences(corpus, assets, straight, seaweed, tmp_path,
                                                                           monkeypatch):
    root, _, _ = corpus
    fs, bucket = seaweed.filesystem(), seaweed.new_bucket()
    for f in sorted((root / "train").iterdir()):
        fs.put(str(f), f"{bucket}/corpus/{f.name}")
    target = "automodel_ckpt.data.stream.corpus.streamed_corpus"
    recipe = _recipe(tmp_path / "s3.yaml", {"_target_": target, "path": f"s3://{bucket}/corpus/*.jsonl"}, None)
    env = seaweed.env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    run = ("--checkpoint.checkpoint_dir", "s3run")
    ckpt_train(tmp_path, assets, *KEYS, *run, "--step_scheduler.max_steps", "3", "--data.num_workers", "2",
               nproc=2, recipe=recipe, env=env)
    ckpt_train(tmp_path, assets, *KEYS, *run, "--step_scheduler.max_steps", "6", nproc=1, recipe=recipe, env=env)
    got = _records(tmp_path / "s3run")
    assert [got[s]["sample_ids"] for s in range(1, 7)] == [straight[s]["sample_ids"] for s in range(1, 7)]
    meta = read_metadata(tmp_path / "s3run" / "epoch_0_step_6")
    assert meta["extra"]["data_position"]["sources"][0]["path"].startswith(f"s3://{bucket}/corpus/train-")
    # each object read by one rank (2 ranks, 6 lanes: no redundancy), counted where the readers open it
    from automodel_ckpt.data.stream import stream as stream_module
    from automodel_ckpt.data.stream.loader import lanes_of
    from automodel_ckpt.data.stream.order import shard_order

    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    opened: list[str] = []
    real = stream_module.read_rows
    monkeypatch.setattr(stream_module, "read_rows", lambda path, *a, **k: (opened.append(path), real(path, *a, **k))[1])
    units = sorted(f"s3://{bucket}/corpus/{f.name}" for f in (root / "train").iterdir())
    first = shard_order(len(units), 42, 0, 0)  # the recipe's seed
    by_rank = []
    for rank in range(2):
        opened.clear()
        ids, _ = _loader_ids(recipe, assets, 3, rank=rank, dp=2)
        assert ids == [i for s in range(1, 4) for i in straight[s]["sample_ids"][rank::2]]
        assert sorted(opened) == sorted(units[first[lane]] for lane in lanes_of(rank, 2, 6)), rank  # once each
        by_rank.append(set(opened))
    assert not by_rank[0] & by_rank[1]


def test_streamed_chats_take_the_loss_on_the_assistant_turns_only(assets, tmp_path, capsys, monkeypatch):
    from automodel_ckpt import cli

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{a}="},
                                                      {"role": "assistant", "content": str(2 * a)}]}) + "\n"
                             for a in range(10, 60)))
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(assets))
    assert cli.main(["preview", str(REPO / "recipes" / "tiny_llama_chat.yaml"), "--num", "3", "--dataset._target_",
                     "automodel_ckpt.data.stream.corpus.streamed_corpus", "--dataset.path", str(chats)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("    ", "  + "))]
    marked = [piece.split("»")[0] for line in rows for piece in line.split("«")[1:]]
    assert marked and all(m.removesuffix("</s>").isdigit() for m in marked if m.removesuffix("</s>"))
    assert "user:" in out and "«user" not in out


def test_preview_ids_prints_a_ranks_training_ids_and_nothing_else(corpus, assets, straight, capsys, monkeypatch):
    from automodel_ckpt import cli

    _, recipe, _ = corpus
    monkeypatch.setenv("AUTOMODEL_CKPT_ASSETS", str(assets))
    assert cli.main(["preview", str(recipe), "--ids", "--num", "12", "--rank", "1", "--world-size", "2", *KEYS]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [str(i) for s in (1, 2) for i in straight[s]["sample_ids"][1::2]]
