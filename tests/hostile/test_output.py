"""Output hygiene: a string from a folder never reaches the terminal with a raw control character.

Each case plants a terminal control sequence (``ESC ] 0 ; pwned BEL`` sets a terminal's title; ``ESC [ 2 J`` clears
it) in a checkpoint folder's name, a quarantine note's reason, a metadata value or a file name, and runs every verb
that prints it. The corpus guarantees, per run: no raw control character other than newline and tab in stdout or
stderr (``clean``), no traceback, and the escaped form shown where the verb names the string.
"""

from __future__ import annotations

import json
import shutil

from tests.hostile.conftest import edit_json, reseal
from tests.hostile.harness import clean, refused_or_reported, succeeded

TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"


def test_a_checkpoint_name_with_control_sequences_is_printed_escaped(make_case):
    case = make_case()
    hostile = case.run_dir / f"epoch_0_step_3{TITLE}"
    shutil.copytree(case.checkpoint(2), hostile)
    edit_json(hostile / "metadata.json", name=hostile.name, step=3)
    reseal(hostile)
    for outcome in (case.verb("inspect", "run"), case.verb("verify", "run"), case.verb("verify", hostile),
                    case.resume(steps=2), case.verb("plot", "run", "--out", "loss.png")):
        clean(outcome)


def test_a_quarantine_reason_with_control_sequences_is_printed_escaped(make_case):
    case = make_case()
    quarantine = case.run_dir / "quarantine"
    shutil.copytree(case.checkpoint(1), quarantine / "epoch_0_step_1")
    (quarantine / "epoch_0_step_1.json").write_text(json.dumps({"name": f"epoch_0_step_1{TITLE}",
                                                                 "reason": f"damaged{CLEAR}{TITLE}",
                                                                 "at": f"2026{TITLE}"}))
    outcome = case.verb("inspect", "run")
    succeeded(outcome)
    assert "\\x1b" in outcome.output or "\\033" in outcome.output or "^[" in outcome.output, str(outcome)
    clean(case.verb("inspect", "run", "--json"))


def test_metadata_values_with_control_sequences_are_printed_escaped(make_case):
    case = make_case()
    second = case.checkpoint(2)
    edit_json(second / "metadata.json", torch_version=TITLE, automodel_ckpt_version=CLEAR, val_loss=TITLE,
              train_loss=CLEAR, model_save_format=TITLE, mesh={"tp": TITLE})
    reseal(second)
    (second / f"stray{TITLE}.bin").write_bytes(b"x")
    for outcome in (case.verb("inspect", "run"), case.verb("inspect", "run", "--json"), case.resume(steps=2)):
        clean(outcome)
    refused_or_reported(case.verb("verify", second), "stray")
