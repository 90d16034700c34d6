"""`ckpt-train export CHECKPOINT --to hf-trainer --out DIR`: a checkpoint as an HF Trainer ``checkpoint-N/`` folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from automodel_ckpt.errors import CheckpointError, UsageError, UserError
from automodel_ckpt.export import ExportRequest, ExportTarget
from automodel_ckpt.ondisk import CheckpointFolder, RunFolder
from automodel_ckpt.training.metrics import iter_jsonl


def export(src: Path, out: Path | None, recipe: Path | None, typed: list[str] | None = None) -> int:
    """``typed``: the recipe's ``--section.key value`` overrides, as the run that trained the checkpoint had them."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise UsageError("export --to hf-trainer runs as one process")
    if recipe is None:
        raise UsageError("export --to hf-trainer: give --recipe RECIPE.yaml, the recipe that trained the checkpoint "
                         f"(its {CheckpointFolder.config} is a copy, never run as a recipe)")
    src = src.absolute()
    recipe_file = Path(recipe)
    if not CheckpointFolder(src).metadata.is_file():
        raise CheckpointError(f"'{src}' is not a checkpoint of ours (no {CheckpointFolder.metadata}): --to hf-trainer "
                              "exports a checkpoint folder (epoch_E_step_N)")
    from automodel_ckpt.config.instantiate import locate
    from automodel_ckpt.cli.common import load_recipe
    from automodel_ckpt.interop import hf_export

    with tempfile.TemporaryDirectory(prefix="hf-trainer-export-") as scratch:
        overrides = ["--checkpoint.checkpoint_dir", scratch, "--checkpoint.restore_from", str(src),
                     "--checkpoint.enabled", "true", "--checkpoint.save_consolidated", "false",
                     "--training.progress_bar", "false", "--distributed.pp_size", "1", "--distributed.tp_size", "1"]
        cfg = load_recipe(str(recipe_file), [*(typed or []), *overrides])
        recipe = locate(cfg.recipe, "recipe")(cfg)
        recipe.setup()
        try:
            if recipe.restore_checkpoint() is None:
                raise CheckpointError(f"'{src}' did not load")
            step = recipe.step_scheduler.step
            target = Path(out) if out is not None else src.parent / f"{src.name}-hf-trainer" / f"checkpoint-{step}"
            log = _log(RunFolder(src.parent).training_log)
            staging = target.with_name(f".{target.name}.partial")
            shutil.rmtree(staging, ignore_errors=True)
            args = hf_export.write(recipe, staging, log)
            from automodel_ckpt.export import export_lineage, write_lineage_file

            write_lineage_file(staging, export_lineage([src]))  # the checkpoint it came from
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            recipe.checkpointer.finalize()
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    print(f"HF Trainer checkpoint written to {target} (step {step}); resume it with "
          f"Trainer.train(resume_from_checkpoint=...) and TrainingArguments({shown}) (per_device_train_batch_size x "
          "gradient_accumulation_steps x processes must stay this global batch)", flush=True)
    return 0


def _log(path: Path) -> list[dict]:
    """The run's ``training.jsonl`` records (the Trainer's log history), if the run folder has one."""
    try:
        records = list(iter_jsonl(path))
    except UserError:
        return []
    return [r for r in records if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))]


class HFTrainerTarget(ExportTarget):
    """``--to hf-trainer``: the recipe given with ``--recipe`` (never the checkpoint's ``config.yaml``, a copy that may
    name any code) built as a 1-process run in a temporary run folder, the checkpoint restored into it, and written
    by ``interop.hf_export``. Its options are the recipe's overrides; the other targets' are not looked at."""

    name = "hf-trainer"
    summary = "a checkpoint as an HF Trainer checkpoint-N/ folder that Trainer.train resumes"
    takes_overrides = True
    checks_other_options = False

    def export(self, request: ExportRequest) -> int:
        args = request.args
        return export(request.src, Path(args.out) if args.out else None, Path(args.recipe) if args.recipe else None,
                      args.overrides)


TARGET = HFTrainerTarget()
