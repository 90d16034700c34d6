"""Links and special files: no verb follows a link out of a folder, opens a FIFO, or writes through our own files.

Each case puts a symlink (to a file or folder of the case's ``Outside``) or a FIFO where a verb expects a file or a
folder of a run, checkpoint or adapter, and runs every verb that meets it. The corpus guarantees, per run: nothing
outside was opened, written, created or deleted (inotify and a snapshot), no byte from there reached the output or
a file written inside, the verb ended before its timeout (a FIFO opened for reading would block it forever), and
it either refused in one ``error:`` line with a non-zero exit or went on without the file (resume: the damaged
checkpoint set aside, the one before loaded). Resume meets every tampered checkpoint of this file in one run
(``gauntlet``); ``restore_from`` is run against a few of them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.conftest import gauntlet, hostile_copy
from tests.hostile.harness import Outside, clean, refused, refused_or_reported, run_script, succeeded

FIFO_TIMEOUT = 20  # a genuine resume takes 2 s; a verb blocked on a FIFO is killed then
SHARD = "model/shard-00001-model-00001-of-00001.safetensors"


def link_folder(rel: str):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        shutil.rmtree(checkpoint / rel)
        os.symlink(outside.dir, checkpoint / rel)
    return tamper


def link_file(rel: str):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        (checkpoint / rel).unlink()
        os.symlink(outside.secret, checkpoint / rel)
    return tamper


def fifo(rel: str):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        (checkpoint / rel).unlink()
        os.mkfifo(checkpoint / rel)
    return tamper


def manifest_naming(entry: str):
    """The first round's case: a manifest listing a file outside (with its true size), relative or absolute."""
    def tamper(checkpoint: Path, outside: Outside) -> None:
        rel = str(outside.secret) if entry == "ABSOLUTE" else entry
        data = json.loads((checkpoint / "manifest.json").read_text())
        data["files"][rel] = {"size": outside.secret.stat().st_size, "checksum": "0"}
        (checkpoint / "manifest.json").write_text(json.dumps(data))
    return tamper


FOLDER_LINKS = {f"{rel} linked outside": link_folder(rel) for rel in ("model/.hf_metadata", "optim", "model")}
FILE_LINKS = {f"{rel} linked outside": link_file(rel)
              for rel in ("metadata.json", "manifest.json", "config.yaml", "model/.hf_metadata/config.json", SHARD)}
FIFOS = {f"{rel} a FIFO": fifo(rel)
         for rel in ("metadata.json", "manifest.json", SHARD, "model/.hf_metadata/config.json", "optim/.metadata")}
MANIFEST_PATHS = {f"manifest naming {e}": manifest_naming(e) for e in ("../../../outside/secret.txt", "ABSOLUTE")}
CASES = {**FOLDER_LINKS, **FILE_LINKS, **FIFOS, **MANIFEST_PATHS}
#: Cases whose damage lies in the model folder: consolidate meets them.
IN_MODEL = [label for label in CASES if label.startswith("model") or SHARD in label]
#: A few cases for restore_from (each costs a model build).
RESTORED = ["model linked outside", "metadata.json linked outside", "metadata.json a FIFO", f"{SHARD} a FIFO"]


@pytest.mark.parametrize("label", CASES)
def test_verify_and_inspect_never_leave_the_checkpoint(make_case, label):
    case = make_case()
    checkpoint = hostile_copy(case, 3, CASES[label])
    refused_or_reported(case.verb("verify", checkpoint, timeout=FIFO_TIMEOUT))
    clean(case.verb("inspect", "run", timeout=FIFO_TIMEOUT))


@pytest.mark.parametrize("label", IN_MODEL)
def test_consolidate_never_leaves_the_checkpoint(make_case, label):
    case = make_case()
    checkpoint = hostile_copy(case, 3, CASES[label])
    refused(case.verb("consolidate", checkpoint, "--out", "export", "--no-progress", timeout=FIFO_TIMEOUT))
    assert not (case.work / "export").exists()


@pytest.mark.parametrize("label", RESTORED)
def test_restore_from_refuses_a_linked_or_special_file(make_case, label):
    case = make_case()
    checkpoint = hostile_copy(case, 3, CASES[label])
    refused(case.restore_from(checkpoint, timeout=FIFO_TIMEOUT))


def test_resume_sets_every_linked_or_special_checkpoint_aside(make_case):
    """One run folder holding every case above as its newest checkpoints, a checkpoint that is a link to an
    outside folder, and pointers linked outside: resume loads the genuine step 2."""
    case = make_case()
    os.symlink(case.outside.dir, case.run_dir / "epoch_0_step_99")
    for pointer in ("LATEST", "LOWEST_VAL"):
        (case.run_dir / pointer).unlink(missing_ok=True)
        os.symlink(case.outside.secret, case.run_dir / pointer)
    gauntlet(case, CASES)


def test_a_checkpoint_or_pointer_linked_outside_designates_nothing(make_case):
    case = make_case()
    os.symlink(case.outside.dir, case.run_dir / "epoch_0_step_99")
    for pointer in ("LATEST", "LOWEST_VAL"):
        (case.run_dir / pointer).unlink(missing_ok=True)
        os.symlink(case.outside.secret, case.run_dir / pointer)
    clean(case.verb("inspect", "run"))
    clean(case.verb("verify", "run"))


# --- our own files ---------------------------------------------------------------------------------------------------


def _refused_or_replaced(outcome) -> None:
    """A lock file that is no regular file: refused in one line naming it, or replaced and the run goes on."""
    clean(outcome)
    if outcome.code:
        refused(outcome, ".run.lock")
    else:
        assert "Saving checkpoint to run/epoch_0_step_3" in outcome.output, str(outcome)


def test_a_run_lock_linked_to_an_outside_file_is_never_written_through(make_case):
    case = make_case()
    os.symlink(case.outside.sentinel, case.run_dir / ".run.lock")
    _refused_or_replaced(case.resume())


def test_a_run_lock_that_is_a_fifo_never_blocks_the_launcher(make_case):
    case = make_case()
    os.mkfifo(case.run_dir / ".run.lock")
    _refused_or_replaced(case.resume(timeout=FIFO_TIMEOUT))


def test_plot_never_writes_its_png_through_a_link(make_case):
    case = make_case()
    os.symlink(case.outside.sentinel, case.run_dir / "loss.png")
    outcome = case.verb("plot", "run")
    clean(outcome)
    if outcome.code:
        refused(outcome, "loss.png")


def test_plot_never_reads_a_training_log_linked_outside_or_a_fifo(make_case):
    case = make_case()
    (case.run_dir / "training.jsonl").unlink()
    os.symlink(case.outside.secret, case.run_dir / "training.jsonl")
    refused(case.verb("plot", "run", "--out", "loss.png"))
    (case.run_dir / "training.jsonl").unlink()
    os.mkfifo(case.run_dir / "training.jsonl")
    refused(case.verb("plot", "run", "--out", "loss.png", timeout=FIFO_TIMEOUT))


def test_merge_lora_never_copies_a_linked_tokenizer_file(make_case):
    case = make_case("peft")
    adapter = case.checkpoint(1) / "model"
    (adapter / "tokenizer.json").unlink()
    os.symlink(case.outside.secret, adapter / "tokenizer.json")
    outcome = case.verb("merge-lora", case.checkpoint(1), "--out", "merged")
    clean(outcome)  # Case.verb already checked that no byte of the linked file reached work/
    if outcome.code:
        refused(outcome, "tokenizer.json")
    else:
        assert not (case.work / "merged" / "tokenizer.json").is_symlink()


def test_merge_lora_never_reads_an_adapter_config_linked_outside(make_case):
    case = make_case("peft")
    adapter = case.checkpoint(1) / "model"
    (adapter / "adapter_config.json").unlink()
    os.symlink(case.outside.secret, adapter / "adapter_config.json")
    refused(case.verb("merge-lora", case.checkpoint(1), "--out", "merged"))


def test_consolidate_sh_never_blocks_on_a_fifo_shard(make_case):
    case = make_case()
    checkpoint = hostile_copy(case, 3, fifo(SHARD))
    outcome = run_script(["bash", checkpoint / "model" / "consolidate.sh", "--out", case.work / "export",
                          "--no-progress"], cwd=case.work, timeout=FIFO_TIMEOUT + 10)
    case.check(outcome)
    refused(outcome)
    assert not (case.work / "export").exists()


def test_a_genuine_run_passes_every_check(make_case):
    """The corpus's control: the same verbs on an untampered copy succeed, touching nothing outside."""
    case = make_case()
    succeeded(case.verb("verify", "run"))
    succeeded(case.verb("inspect", "run"))
    succeeded(case.verb("consolidate", case.checkpoint(2), "--out", "export", "--no-progress"))
