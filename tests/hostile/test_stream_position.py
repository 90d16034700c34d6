"""A checkpointed stream position whose fields are out of their real bounds: one line, never a traceback.

A genuine streamed run (one json-lines file of documents longer than a sequence, so a document is carried over;
checkpoints at steps 1 and 2) is made once; in a copy of it, the newest checkpoint's data position (every lane's) is damaged and
the checkpoint resealed, as anyone who rewrites a checkpoint can. The resume must refuse in one ``error:`` line (a
field checked when the checkpoint is loaded names the checkpoint's file), with a non-zero exit, no traceback (the
carry-over past its document once ended in numpy's), and nothing outside the case touched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.hostile.conftest import reseal
from tests.hostile.harness import refused, succeeded
from tests.hostile.test_stream_files import SMALL_RUN, _recipe, bare_case  # noqa: F401 - bare_case: a fixture

RUN = (*SMALL_RUN, "--data.shuffle", "true", "--data.shuffle_buffer", "256", "--step_scheduler.ckpt_every_steps",
       "1", "--checkpoint.checkpoint_dir", "run")
STATE = "epoch_0_step_2/dataloader/dataloader_dp_rank_0.pt"


def _lanes(state) -> list[dict]:
    """Every stream position in a loader's state (one per lane, or the one global stream's)."""
    if isinstance(state, dict):
        if "pending" in state and "offset" in state:
            return [state]
        return [p for v in state.values() for p in _lanes(v)]
    return []


def _carry_past(p: dict) -> bool:
    if p["pending"]:
        p["offset"] = 10**6
    return bool(p["pending"])


def _row_past(p: dict) -> bool:
    for d in p["pending"]:
        d[2] = 10**9
    return bool(p["pending"])


def _tokens(p: dict) -> bool:
    p["sources"][0]["tokens"] += 1
    return True


def _epoch(p: dict) -> bool:
    for d in p["pending"]:
        d[3] = p["sources"][d[0]]["epoch"] + 1
    return bool(p["pending"])


def _docs(p: dict) -> bool:
    p["docs"] += 3
    return True


DAMAGES = {"the carry-over past its document": (_carry_past, "a carry-over of 1000000 tokens into", False),
           "a pending row past its file's end": (_row_past, "a row at byte 1000000000 of", True),
           "tokens that do not add up": (_tokens, "tokens to", True),
           "a pending document from a later epoch": (_epoch, "its source is at epoch", True),
           "documents that do not add up": (_docs, "drawn", True)}


@pytest.fixture(scope="module")
def streamed_run(server, assets, tmp_path_factory) -> tuple[Path, Path]:
    """``(run folder, recipe)`` of the genuine run, made once; its corpus stays where it is (a corpus's paths are
    part of the run's identity), each case resumes a copy of the run folder."""
    import yaml

    root = tmp_path_factory.mktemp("streamed_genuine")
    (root / "data").mkdir()
    (root / "data" / "z.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 12}) + "\n"
                                                   for i in range(200)))
    recipe = _recipe(root)
    cfg = yaml.safe_load(recipe.read_text())
    cfg["dataset"]["path"] = str(root / "data" / "*.jsonl")
    recipe.write_text(yaml.safe_dump(cfg))
    (root / "work").mkdir()
    succeeded(server.run([recipe, *RUN, "--step_scheduler.max_steps", "2"], cwd=root / "work",
                         env={"AUTOMODEL_CKPT_ASSETS": str(assets)}, timeout=300))
    return root / "work" / "run", recipe


@pytest.mark.parametrize("label", list(DAMAGES))
def test_a_position_out_of_its_bounds_is_one_line(bare_case, streamed_run, label):
    case = bare_case()
    genuine, recipe = streamed_run
    shutil.copytree(genuine, case.work / "run", symlinks=True)
    damage, expected, names_file = DAMAGES[label]
    file: Path = case.work / "run" / STATE
    state = torch.load(file, weights_only=True)
    lanes = _lanes(state)
    assert lanes and sum(damage(p) for p in lanes) >= 1, label
    torch.save(state, file)
    reseal(file.parents[1])
    outcome = case.verb(recipe, *RUN, "--step_scheduler.max_steps", "3", timeout=120)
    line = refused(outcome, "the checkpoint's data position is malformed", expected)
    assert ("run/" + STATE in line) == names_file, line
    assert "Saving checkpoint to run/epoch_0_step_3" not in outcome.output, outcome


def test_the_genuine_position_resumes(bare_case, streamed_run):
    case = bare_case()
    genuine, recipe = streamed_run
    shutil.copytree(genuine, case.work / "run", symlinks=True)
    outcome = case.verb(recipe, *RUN, "--step_scheduler.max_steps", "3", timeout=120)
    succeeded(outcome)
    assert "Saving checkpoint to run/epoch_0_step_3" in outcome.output, outcome
