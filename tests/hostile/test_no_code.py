"""No verb runs anything a checkpoint, an export folder or an archive names.

A checkpoint holds a copy of its recipe (``config.yaml``) and Hugging Face files (``config.json``,
``tokenizer_config.json``, ``generation_config.json``, ``adapter_config.json``); a received one may name code in
any of them. Every such file of a genuine run, its export folder, a LoRA run and archives packed from them is
planted here with what would run code if anything built from it: ``_target_`` sections calling ``os.makedirs``
(a marker folder) or a ``file.py:Name`` whose import alone touches a marker, ``recipe: file.py:Name``, and
transformers' ``auto_map`` naming that module (placed beside each ``config.json``; only ``trust_remote_code``
would import it). Then every verb that reads them runs: `inspect` (``--cost`` too), `verify` (``--export`` too),
`consolidate`, `export` (gguf and int8, ``--dry-run`` and ``--calibrate``, ``--adapter``), `pack`, `merge-lora`,
`average`, `plot`, `gc`, a resume and ``restore_from`` a checkpoint or an archive. Whatever each decides, no
marker exists afterwards, nothing outside the case was touched, and the output holds no traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from tests.hostile.conftest import SFT, reseal
from tests.hostile.harness import clean, lean

EVIL = '''import pathlib
MARKERS = pathlib.Path({markers!r})
(MARKERS / ("imported-" + __name__)).touch()


def make(*args, **kwargs):
    (MARKERS / "called").touch()


class Made:
    def __init__(self, *args, **kwargs):
        (MARKERS / "constructed").touch()
'''
HF_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "adapter_config.json")


class Planter:
    """Plants code-naming entries in every recipe copy and Hugging Face file below a folder."""

    def __init__(self, root: Path) -> None:
        self.markers = root / "markers"
        self.markers.mkdir()
        self.module = root / "evil_mod.py"
        self.module.write_text(EVIL.format(markers=str(self.markers)))
        self.recipes = 0

    def target(self, name: str) -> dict:
        return {"_target_": "os.makedirs", "name": str(self.markers / name)}

    def _retarget(self, node):
        """``node`` with every ``_target_`` naming ``evil_mod.py:make`` (which takes any arguments), so that the
        recipe stays valid and reaches whatever would build from it."""
        if isinstance(node, dict):
            return {k: (f"{self.module}:make" if k == "_target_" else self._retarget(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [self._retarget(v) for v in node]
        return node

    def plant(self, folder: Path) -> None:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            if path.name == "config.yaml":  # every _target_ of the recipe copy now names the module
                recipe = self._retarget(yaml.safe_load(path.read_text()) or {})
                if "recipe" in recipe:
                    recipe["recipe"] = f"{self.module}:Made"
                path.write_text(yaml.safe_dump(recipe))
                self.recipes += 1
            elif path.name in HF_FILES:
                data = json.loads(path.read_text())
                data.update({"_target_": f"{self.module}:make", "model": self.target(path.stem),
                             "auto_map": {"AutoConfig": "evil_mod.Made", "AutoModelForCausalLM": "evil_mod.Made",
                                          "AutoTokenizer": ["evil_mod.Made", None]}})
                path.write_text(json.dumps(data))
                (path.parent / "evil_mod.py").write_text(self.module.read_text())  # what auto_map names
        for checkpoint in folder.rglob("metadata.json"):
            if (checkpoint.parent / "manifest.json").is_file():
                reseal(checkpoint.parent)  # as anyone who alters a checkpoint can

    def check(self, outcome) -> None:
        made = sorted(p.name for p in self.markers.iterdir())
        assert not made, f"code named by the input ran ({made}):\n{outcome}"
        clean(outcome)


def _runs(case, planter: Planter, verbs: list[list[object]]) -> None:
    for argv in verbs:
        outcome = case.verb(*argv)
        planter.check(outcome)
        lean(outcome, case.server.rss)  # a tiny model: nothing a planted file names was built or loaded


def test_no_verb_runs_what_a_checkpoint_an_export_or_an_archive_names(make_case, tmp_path):
    case = make_case()
    planter = Planter(tmp_path)
    planter.plant(case.run_dir)
    assert planter.recipes >= 2
    step1, step2 = case.checkpoint(1), case.checkpoint(2)
    export = step1 / "model" / "consolidated"
    _runs(case, planter, [
        ["inspect", "run"], ["inspect", "run", "--cost"], ["inspect", step2], ["verify", "run"], ["verify", step2],
        ["verify", "--export", step1], ["consolidate", step2, "--out", "c2", "--no-progress"],
        ["export", step2, "--to", "gguf", "--dry-run"], ["export", step2, "--to", "gguf", "--out", "g.gguf",
                                                         "--no-progress"],
        ["export", step2, "--to", "int8", "--out", "i8", "--no-progress"],
        ["export", step2, "--to", "int8", "--calibrate", "2", "--dry-run"],
        ["export", step2, "--to", "int8", "--calibrate", "2", "--out", "i8c", "--no-progress"],
        ["export", export, "--to", "int8", "--calibrate", "2", "--out", "i8e", "--no-progress"],
        ["export", export, "--to", "gguf", "--out", "ge.gguf", "--no-progress"],
        ["pack", step2, "--out", "a.tar", "--no-progress"], ["pack", export, "--out", "e.tar", "--no-progress"],
        ["inspect", "a.tar"], ["verify", "a.tar"], ["verify", "e.tar"],
        ["export", "a.tar", "--to", "gguf", "--out", "ga.gguf", "--no-progress"],
        ["export", "e.tar", "--to", "int8", "--calibrate", "2", "--out", "i8a", "--no-progress"],
        ["export", step2, "--to", "hf-trainer", "--out", "hft"],
        ["export", step2, "--to", "hf-trainer", "--recipe", SFT, "--out", "hft"],
        ["average", step1, step2, "--out", "avg"], ["plot", "run", "--out", "loss.png"], ["gc", "run"],
    ])
    planter.check(case.resume(steps=2))
    planter.check(case.restore_from(step2))
    planter.check(case.restore_from(case.work / "a.tar"))


def test_no_verb_runs_what_a_lora_checkpoint_names(make_case, tmp_path):
    case = make_case("peft")
    planter = Planter(tmp_path)
    planter.plant(case.run_dir)
    step1 = case.checkpoint(1)
    _runs(case, planter, [
        ["inspect", step1], ["verify", step1], ["merge-lora", step1, "--out", "merged"],
        ["export", step1, "--to", "gguf", "--adapter", "--type", "f16", "--out", "lora.gguf"],
        ["export", step1, "--to", "gguf", "--out", "m.gguf", "--no-progress"],
        ["pack", step1, "--out", "l.tar", "--no-progress"], ["verify", "l.tar"],
    ])
    assert os.listdir(planter.markers) == []
