"""`diff` on a hostile checkpoint: every file it reads on either side that is no regular file is refused in one line.

Each case replaces one file ``diff`` reads (the recipe, the metadata, the model's config and tensor tables, a shard,
a DCP file, an adapter's files, a tokenizer file) with a link to a file or FIFO outside, a link to ``/etc/passwd`` or
``/dev/zero``, a dangling link, a FIFO or a folder (or makes it unreadable, where the tests do not run as root), and
compares that checkpoint with its genuine original, both ways round. The corpus guarantees per run: one ``error:`` line naming the file and exit 2, no traceback, nothing outside
opened, and an end before the timeout (a FIFO opened for reading would block forever).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.harness import Outside, clean, error_lines, refused

TIMEOUT = 20  # a diff of the tiny model takes a second; one blocked on a FIFO is killed then
SHARD = "model/shard-00001-model-00001-of-00001.safetensors"
HF_METADATA = "model/.hf_metadata"


def _link(target):
    return lambda path, outside: path.symlink_to(target(outside))


def _fifo(path: Path, outside: Outside) -> None:
    os.mkfifo(path)


def _folder(path: Path, outside: Outside) -> None:
    path.mkdir()
    (path / "inner.json").write_text("{}")


REPLACEMENTS = {
    "linked to a file outside": _link(lambda o: o.secret),
    "linked to /etc/passwd": _link(lambda o: "/etc/passwd"),
    "linked to /dev/zero": _link(lambda o: "/dev/zero"),
    "linked to a FIFO outside": _link(lambda o: o.pipe),
    "a dangling link": _link(lambda o: "/nonexistent/file"),
    "a FIFO": _fifo,
    "a folder": _folder,
}
READ = {  # the files diff reads of each genuine run's checkpoint
    "full": ["metadata.json", "config.yaml", f"{HF_METADATA}/config.json", f"{HF_METADATA}/original_tensors.json",
             f"{HF_METADATA}/saved_state.json", f"{HF_METADATA}/tokenizer.json",
             f"{HF_METADATA}/tokenizer_config.json", f"{HF_METADATA}/generation_config.json",
             f"{HF_METADATA}/chat_template.jinja", SHARD],
    "dcp": ["metadata.json", "model/.metadata", "model/__0_0.distcp"],
    "peft": ["metadata.json", "config.yaml", "model/adapter_config.json", "model/adapter_model.safetensors",
             "model/tokenizer.json"],
}
CASES = [(kind, rel) for kind, files in READ.items() for rel in files]
#: A full run's recipe and metadata (read first, by every comparison) get every replacement; each other file the two that
#: a read would hang on or misread (a link to a FIFO outside, a folder): a diff is a process of its own each time.
EVERY = ("metadata.json", "config.yaml")
SOME = ("linked to a FIFO outside", "a folder")


def _genuine(case, kind: str) -> Path:
    return case.checkpoint(1 if kind == "peft" else 2)


@pytest.mark.parametrize("kind,rel", CASES, ids=[f"{kind}:{rel}" for kind, rel in CASES])
def test_a_file_diff_reads_that_is_no_regular_file_is_refused_in_one_line(make_case, kind, rel):
    case = make_case(kind)
    genuine = _genuine(case, kind)
    replacements = [(k, v) for k, v in REPLACEMENTS.items() if (kind == "full" and rel in EVERY) or k in SOME]
    for i, (label, replace) in enumerate(replacements):
        hostile = case.work / f"hostile_{i}"
        shutil.copytree(genuine, hostile, symlinks=True)
        (hostile / rel).unlink()
        replace(hostile / rel, case.outside)
        for pair in ((hostile, genuine), (genuine, hostile)):
            outcome = case.verb("diff", *pair, timeout=TIMEOUT)
            assert outcome.code == 2, f"{label}:\n{outcome}"
            refused(outcome, Path(rel).name)


UNREADABLE = ["metadata.json", "config.yaml", "model", HF_METADATA, f"{HF_METADATA}/tokenizer.json", SHARD]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_a_file_or_folder_diff_cannot_read_is_refused_in_one_line(make_case):
    case = make_case()
    genuine = case.checkpoint(2)
    for i, rel in enumerate(UNREADABLE):
        hostile = case.work / f"hostile_{i}"
        shutil.copytree(genuine, hostile, symlinks=True)
        os.chmod(hostile / rel, 0)
        try:
            for pair in ((hostile, genuine), (genuine, hostile)):
                outcome = case.verb("diff", *pair, timeout=TIMEOUT)
                assert outcome.code == 2, f"{rel}:\n{outcome}"
                refused(outcome, Path(rel).name, "Permission denied")
        finally:
            os.chmod(hostile / rel, 0o755)


def test_genuine_checkpoints_compare_their_recipes_and_counters_and_a_missing_recipe_is_left_out(make_case):
    case = make_case()
    one, two = case.checkpoint(1), case.checkpoint(2)
    with open(one / "config.yaml", "a") as f:
        f.write("added_key: 7\n")
    outcome = _different(case.verb("diff", one, two, timeout=TIMEOUT))
    assert "Recipe keys that differ:\n  added_key: 7 -> None\n" in outcome.stdout, outcome
    assert "Counters:\n  consumed_samples: 4 -> 8\n  step: 1 -> 2\n" in outcome.stdout, outcome
    (one / "config.yaml").unlink()  # a checkpoint without its recipe: the counters alone
    outcome = _different(case.verb("diff", one, two, timeout=TIMEOUT))
    assert "Recipe keys" not in outcome.stdout and "step: 1 -> 2" in outcome.stdout, outcome


def _different(outcome):
    """diff(1)'s exit 1 (something differs), with no error line and no traceback."""
    clean(outcome)
    assert outcome.code == 1 and not error_lines(outcome), outcome
    return outcome
