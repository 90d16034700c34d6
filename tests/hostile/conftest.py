"""The corpus's fixtures: one fork server per session, the genuine runs every case copies, and ``Case``.

The genuine runs are made once per session by the code under test, through ``ckpt-train RECIPE.yaml`` itself, so a
resume of a copy passes the fingerprint check and reaches the load: a full fine-tune in safetensors with
TensorBoard tracking (checkpoints at steps 1 and 2, step 1 exported), the same in DCP (``torch_save``), and a LoRA
run. A ``Case`` is a copy of one of them in a fresh folder, tampered by the test, beside an ``Outside`` folder that
no verb may touch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hostile.harness import CODE_ROOT_ENV, ForkServer, Outcome, Outside, marker_in_tree, succeeded

CODE = Path(os.environ.get(CODE_ROOT_ENV) or Path(__file__).resolve().parents[2])
SFT = CODE / "recipes" / "tiny_llama_sft.yaml"
PEFT = CODE / "recipes" / "tiny_llama_peft.yaml"
#: The smallest training run that still saves, tracks and resumes: 4 samples a step, a checkpoint every step.
TRAIN = ("--training.progress_bar", "false", "--step_scheduler.ckpt_every_steps", "1",
         "--step_scheduler.val_every_steps", "100", "--step_scheduler.global_batch_size", "4",
         "--step_scheduler.local_batch_size", "4", "--data.val_size", "4", "--dataset.num_samples", "64",
         "--checkpoint.save_consolidated", "false", "--checkpoint.checkpoint_dir", "run")
TENSORBOARD = ("--logging.tensorboard.log_dir", "null")
DCP = ("--checkpoint.model_save_format", "torch_save")


def train_args(recipe: Path, steps: int, *extra: str) -> list[str]:
    return [str(recipe), *TRAIN, "--step_scheduler.max_steps", str(steps), *extra]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    fork_server = ForkServer(tmp_path_factory.mktemp("fork_server"), os.environ.get(CODE_ROOT_ENV))
    yield fork_server
    fork_server.close()


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the embedded tiny base is created by the first run that needs it."""
    return tmp_path_factory.mktemp("hostile_assets")


def _train(server: ForkServer, work: Path, assets: Path, argv: list[str]) -> None:
    work.mkdir(parents=True)
    done = server.run(argv, cwd=work, env={"AUTOMODEL_CKPT_ASSETS": str(assets)}, timeout=300)
    succeeded(done)


@pytest.fixture(scope="session")
def genuine(server: ForkServer, assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders holding ``run/``, one per kind: ``full`` (safetensors, TensorBoard tracking, steps 1 and 2, step 2
    exported to ``model/consolidated``), ``dcp`` (the same in torch_save) and ``peft`` (a LoRA run, step 1)."""
    root = tmp_path_factory.mktemp("genuine")
    _train(server, root / "full", assets, train_args(SFT, 2, *TENSORBOARD))
    exported = server.run(["consolidate", "run/epoch_0_step_1", "--no-progress"], cwd=root / "full", timeout=300)
    succeeded(exported)
    _train(server, root / "dcp", assets, train_args(SFT, 2, *DCP))
    _train(server, root / "peft", assets, train_args(PEFT, 1))
    return {"full": root / "full", "dcp": root / "dcp", "peft": root / "peft"}


def reseal(checkpoint: Path) -> None:
    """Rewrite a checkpoint's manifest for its current files, as anyone who alters a checkpoint can."""
    from automodel_ckpt.ondisk import manifest

    manifest.seal(checkpoint, 0, 1)


def edit_json(path: Path, **values: object) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


@dataclass
class Case:
    """A copy of a genuine run in ``work/run`` (or an empty ``work/``), an ``Outside`` beside it, and the verbs."""

    server: ForkServer
    assets: Path
    work: Path
    outside: Outside
    started_ns: int = 0

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    def checkpoint(self, step: int) -> Path:
        return self.run_dir / f"epoch_0_step_{step}"

    def verb(self, *argv: object, env: dict[str, str] | None = None, timeout: float | None = None) -> Outcome:
        """``ckpt-train ARGV`` run in ``work/``; then nothing outside was touched and nothing from there copied in."""
        kw = {"timeout": timeout} if timeout else {}
        self.started_ns = time.time_ns() - 10**9  # files the verb writes are newer (mtime granularity aside)
        outcome = self.server.run(list(argv), cwd=self.work, env={"AUTOMODEL_CKPT_ASSETS": str(self.assets),
                                                                   **(env or {})}, **kw)
        self.check(outcome)
        return outcome

    def check(self, outcome: Outcome) -> None:
        self.outside.check(outcome.output, context=str(outcome))
        copied = marker_in_tree(self.work, self.outside.marker, self.started_ns)
        assert not copied, f"files written from outside the case: {copied}\n{outcome}"

    def resume(self, *extra: str, recipe: Path = SFT, steps: int = 3, env: dict[str, str] | None = None,
               timeout: float | None = None) -> Outcome:
        """The recipe again on ``work/run``: a resume from its newest checkpoint that loads."""
        return self.verb(*train_args(recipe, steps, *extra), env=env, timeout=timeout)

    def restore_from(self, checkpoint: Path, *extra: str, timeout: float | None = None) -> Outcome:
        """A new run (``work/fresh``) that starts from ``checkpoint`` (``checkpoint.restore_from``)."""
        return self.verb(*train_args(SFT, 3, "--checkpoint.checkpoint_dir", "fresh", "--checkpoint.restore_from",
                                     str(checkpoint), *extra), timeout=timeout)


Tamper = Callable[[Path, Outside], None]


def hostile_copy(case: Case, step: int, tamper: Tamper) -> Path:
    """A copy of the genuine step 2 as checkpoint ``step`` (metadata and manifest rewritten to match), tampered."""
    checkpoint = case.checkpoint(step)
    shutil.copytree(case.checkpoint(2), checkpoint, symlinks=True)
    edit_json(checkpoint / "metadata.json", name=checkpoint.name, step=step)
    reseal(checkpoint)
    tamper(checkpoint, case.outside)
    return checkpoint


def gauntlet(case: Case, tampers: dict[str, Tamper], timeout: float = 40) -> Outcome:
    """Resume a run whose newest checkpoints are each tampered one way (steps 3, 4, ... above the genuine 1 and 2):
    every one must be set aside in turn (one resume meets them all, for the time it costs) and the genuine step 2
    loaded; ``max_steps`` 2 then ends the run without training."""
    made = [hostile_copy(case, step, tamper) for step, tamper in enumerate(tampers.values(), start=3)]
    outcome = case.resume(steps=2, timeout=timeout)
    succeeded(outcome)
    assert "Loading checkpoint from run/epoch_0_step_2\n" in outcome.output, str(outcome)
    for checkpoint, label in zip(made, tampers):
        assert f"Loading checkpoint from run/{checkpoint.name}\n" not in outcome.output, f"{label}:\n{outcome}"
    return outcome


@pytest.fixture
def make_case(server: ForkServer, assets: Path, genuine: dict[str, Path], tmp_path: Path):
    """``make_case(kind)``: a fresh ``Case`` copying genuine run ``kind`` (``None``: an empty ``work/``)."""
    made: list[Case] = []

    def make(kind: str | None = "full") -> Case:
        root = tmp_path / f"case{len(made)}"
        work = root / "work"
        if kind is None:
            work.mkdir(parents=True)
        else:
            shutil.copytree(genuine[kind], work, symlinks=True)
        case = Case(server, assets, work, Outside(root / "outside"))
        made.append(case)
        return case

    yield make
    for case in made:
        case.outside.close()
