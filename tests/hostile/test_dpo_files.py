"""A preference run's stored files: its precomputed reference log-probs and its counters (``dpo.pt``).

One genuine DPO run (precomputed reference log-probs, checkpoints at steps 1 and 2) is made per module through
``ckpt-train`` itself; each case copies it and tampers one file. The corpus guarantees, per resume: a stored table
that is a pickle of anything else (one that would run code included), shorter or longer than the pairs, or holding
NaN or an infinity, a FIFO, a link out of the run folder, or a ``ref_log_probs`` folder that is such a link is
refused in one line naming the file, with a non-zero exit; nothing runs, and nothing outside the case is opened or
written (inotify, snapshot). A ``dpo.pt`` of the wrong type, or with counters of the wrong type, is one line naming
the file (its path in the checkpoint), with a non-zero exit.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.hostile.conftest import CODE, Case, edit_json, reseal
from tests.hostile.harness import ForkServer, Outside, refused, succeeded

DPO = CODE / "recipes" / "tiny_llama_dpo.yaml"
ARGS = ("--dpo.precompute_ref_log_probs", "true", "--dataset.num_samples", "64", "--validation_dataset.num_samples",
        "16", "--step_scheduler.global_batch_size", "8", "--step_scheduler.local_batch_size", "8",
        "--step_scheduler.ckpt_every_steps", "1", "--step_scheduler.val_every_steps", "100",
        "--checkpoint.checkpoint_dir", "run", "--training.progress_bar", "false",
        "--checkpoint.save_consolidated", "false")
PAIRS = {"train": 64, "validation": 16}
FIFO_TIMEOUT = 40  # a resume takes a few seconds; one blocked on a FIFO is killed then


def _dpo(steps: int) -> list[object]:
    return [DPO, *ARGS, "--step_scheduler.max_steps", str(steps)]


@pytest.fixture(scope="module")
def dpo_run(server: ForkServer, assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("dpo_genuine")
    succeeded(server.run(_dpo(2), cwd=work, env={"AUTOMODEL_CKPT_ASSETS": str(assets)}, timeout=300))
    return work


@pytest.fixture
def dpo_case(server, assets, dpo_run, tmp_path):
    """A copy of the genuine DPO run in ``work/``, an ``Outside`` beside it; ``(case, stored table file)``."""
    shutil.copytree(dpo_run, tmp_path / "work", symlinks=True)
    case = Case(server, assets, tmp_path / "work", Outside(tmp_path / "outside"))
    (table,) = (case.work / "run" / "ref_log_probs").iterdir()
    yield case, table
    case.outside.close()


def _tables(table: Path) -> dict:
    return torch.load(table, weights_only=True)


def _save(table: Path, **tables: torch.Tensor) -> None:
    saved = _tables(table)
    saved["tables"].update(tables)
    torch.save(saved, table)


class _Runs:
    """A pickle that calls ``os.system`` when unpickled: it would create the marker file named."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle(table: Path, outside: Outside) -> None:
    table.write_bytes(pickle.dumps({"key": table.stem, "tables": {"train": _Runs(outside.root / "ran")}}))


def _short(table: Path, outside: Outside) -> None:
    _save(table, train=_tables(table)["tables"]["train"][:, :40])


def _long(table: Path, outside: Outside) -> None:
    t = _tables(table)["tables"]["validation"]
    _save(table, validation=torch.cat([t, t], 1))


def _nan(table: Path, outside: Outside) -> None:
    t = _tables(table)["tables"]["train"].clone()
    t[1, 7] = float("nan")
    _save(table, train=t)


def _inf(table: Path, outside: Outside) -> None:
    t = _tables(table)["tables"]["validation"].clone()
    t[0, 3] = float("inf")
    _save(table, validation=t)


def _fifo(table: Path, outside: Outside) -> None:
    table.unlink()
    os.mkfifo(table)


def _link_out(table: Path, outside: Outside) -> None:
    table.unlink()
    os.symlink(outside.secret, table)


def _folder_out(table: Path, outside: Outside) -> None:
    shutil.rmtree(table.parent)
    os.symlink(outside.dir, table.parent)


TABLES = {"a pickle that runs code": (_pickle, "cannot be read"),
          "shorter than the pairs": (_short, "shape [2, 40], this run has 64 pairs"),
          "longer than the pairs": (_long, "shape [2, 32], this run has 16 pairs"),
          "holding NaN": (_nan, "not finite (nan) for 'train' pair 7"),
          "holding an infinity": (_inf, "not finite (inf) for 'validation' pair 3"),
          "a FIFO": (_fifo, "FIFO"),
          "a link out of the run folder": (_link_out, "is a link"),
          "its folder a link out of the run folder": (_folder_out, "outside the run folder")}


@pytest.mark.parametrize("label", list(TABLES))
def test_a_stored_log_prob_table_is_checked_before_use(dpo_case, label):
    case, table = dpo_case
    tamper, expected = TABLES[label]
    tamper(table, case.outside)
    outcome = case.verb(*_dpo(3), timeout=FIFO_TIMEOUT)
    line = refused(outcome, f"run/ref_log_probs/{table.name}", expected, "delete the file to compute them again")
    assert "Saving checkpoint" not in outcome.output, line  # refused before any step
    assert not (case.outside.root / "ran").exists()


def _counters(value):
    def tamper(checkpoint: Path) -> None:
        torch.save(value, checkpoint / "dpo.pt")
    return tamper


DPO_PT = {"a list": (_counters([3, 24]), "the preference counters are a list, not a mapping"),
          "a tensor": (_counters(torch.zeros(4)), "the preference counters are a Tensor"),
          "a string count": (_counters({"dpo_step": "2", "consumed_pairs": 16}), "'dpo_step' is a string"),
          "a negative count": (_counters({"dpo_step": 2, "consumed_pairs": -16}), "'consumed_pairs' is the integer -16"),
          "a fingerprint that is a path": (_counters({"dpo_step": 2, "ref_log_probs_key": "../../x"}),
                                           "'ref_log_probs_key' is a string of 7 characters")}


@pytest.mark.parametrize("label", list(DPO_PT))
def test_a_dpo_pt_of_the_wrong_type_is_one_line_naming_it(dpo_case, label):
    """The newest checkpoint (a copy of step 2 as step 3, resealed: only its ``dpo.pt`` differs) is refused in one
    line naming its ``dpo.pt`` by its path; nothing is trained on it."""
    case, _ = dpo_case
    run = case.work / "run"
    tamper, expected = DPO_PT[label]
    checkpoint = run / "epoch_0_step_3"
    shutil.copytree(run / "epoch_0_step_2", checkpoint, symlinks=True)
    edit_json(checkpoint / "metadata.json", name=checkpoint.name, step=3)
    tamper(checkpoint)
    reseal(checkpoint)
    outcome = case.verb(*_dpo(4), timeout=FIFO_TIMEOUT)
    refused(outcome, "'run/epoch_0_step_3/dpo.pt': the preference counters", expected)
    assert "Loading checkpoint from run/epoch_0_step_3\n" in outcome.output, outcome
    assert "Saving checkpoint" not in outcome.output, outcome


def test_a_table_of_hundreds_of_megabytes_is_refused_before_it_is_read(dpo_case, tmp_path):
    """A stored table far larger than its pairs can take (a sparse file of 512 MiB) is refused from its size: the
    resume's peak memory is that of a refusal of a small bad table, not the file's."""
    case, table = dpo_case
    _short(table, case.outside)
    small = case.verb(*_dpo(3), timeout=FIFO_TIMEOUT)
    refused(small, "this run has 64 pairs")
    table.unlink()
    with open(table, "wb") as f:
        f.truncate(512 * 2**20)
    outcome = case.verb(*_dpo(3), timeout=FIFO_TIMEOUT)
    refused(outcome, f"run/ref_log_probs/{table.name}", f"are {512 * 2**20} bytes, more than")
    grown = outcome.maxrss - small.maxrss
    assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB:\n{outcome}"
