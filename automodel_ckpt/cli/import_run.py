"""`ckpt-train import SRC RECIPE.yaml --out RUN_DIR`: another trainer's checkpoint as our checkpoint of its step.

How (checked source, written recipe, 1-process build, state applied and saved): docs/import.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from automodel_ckpt.cli.common import VerbParser, check_recipe, load_recipe
from automodel_ckpt.errors import ConfigError, UsageError
from automodel_ckpt.ondisk import RunFolder, scan_checkpoints


def build_parser() -> VerbParser:
    p = VerbParser("import", "Write an HF Trainer, Lightning, DeepSpeed or torchtitan checkpoint as a checkpoint of "
                             "RECIPE's run in RUN_DIR, which the recipe resumes from at any world size.")
    p.add_argument("src", help="an HF Trainer checkpoint-N/ folder, a Lightning .ckpt file or distributed checkpoint "
                               "folder, a DeepSpeed checkpoint folder or a torchtitan step-N/ folder")
    p.add_argument("recipe", help="the recipe YAML that continues the run; --section.key value overrides may follow")
    p.add_argument("--out", required=True, help="the run folder to write (the recipe's checkpoint_dir from now on); "
                                                "it must hold no checkpoint yet")
    p.add_argument("--check", action="store_true", help="print the logits of the imported model against those of "
                                                        "the source's weights on fixed probe tokens")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.overrides = rest  # recipe overrides (a key, or a whole section: --lr_scheduler '{...}'), checked by the loader
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise UsageError("import runs as one process: start it without --nproc-per-node or torchrun")
    from automodel_ckpt.config.instantiate import locate
    from automodel_ckpt.config.loader import load_yaml, parse_value, split_overrides, to_yaml_data

    src, out = Path(args.src), Path(args.out)
    # one process holding the whole model: the resume reshards it onto the recipe's own mesh and world size
    one_process = ["--distributed.tp_size", "1", "--distributed.pp_size", "1", "--distributed.dp_size", "1",
                   "--distributed.dp_replicate_size", "1", "--distributed.ep_size", "1",
                   "--distributed.sequence_parallel", "false", "--training.compile", "false"]
    for_import = [*one_process, "--checkpoint.checkpoint_dir", str(out), "--checkpoint.enabled", "true",
                  "--checkpoint.restore_from", "null", "--training.progress_bar", "false"]
    cfg = load_recipe(args.recipe, [*args.overrides, *for_import])
    if cfg.training.get("ema_decay") is not None:
        raise ConfigError("training.ema_decay: the source holds no moving average of its weights to import; "
                          "import into a recipe without one (--training.ema_decay null)")
    check_recipe(cfg, 1, inputs=False)
    from automodel_ckpt.interop import read_source, recipe as continuing

    run = read_source(src, source_limits(cfg))  # every file of the source checked before the recipe is built
    if run.schedule.target is None:
        raise ConfigError(f"lr_scheduler: {run.schedule.why_not}")
    if out.is_dir() and scan_checkpoints(out):
        raise UsageError(f"--out '{out}' holds checkpoints already: import into a new run folder")
    if out.is_symlink() or RunFolder(out).import_recipe.is_symlink():
        raise UsageError(f"--out '{out}': a link; import into a new run folder")
    typed = [(key, parse_value(text)) for key, text in split_overrides(args.overrides)]
    data, added = continuing.written(load_yaml(args.recipe), typed, run, str(out))
    written = RunFolder(out).import_recipe
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written.write_text(continuing.header(run, str(src), str(args.recipe), args.overrides, added) + to_yaml_data(data),
                       encoding="utf-8")
    try:
        cfg = load_recipe(written, for_import)  # the file's run is the one imported
        check_recipe(cfg, 1, inputs=False)
    except BaseException:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise
    recipe = locate(cfg.recipe, "recipe")(cfg)
    from automodel_ckpt.checkpoint import SaveInfo
    from automodel_ckpt.interop.apply import apply

    try:
        recipe.setup()
        say = recipe.progress.write
        counters = apply(run, recipe, str(src), say)
        if args.check:
            from automodel_ckpt.interop.check import check_line

            print(check_line(run, recipe.model, str(src)), flush=True)
        from automodel_ckpt.export import lineage_parent

        record = recipe.lineage_record(None)
        record["parents"].append(lineage_parent("imported from", src, follow=True, trainer=run.kind, step=run.step))
        info = SaveInfo(counters["epoch"], counters["step"], counters["loss"], None, is_final=False,
                        extra={"consumed_samples": counters["consumed_samples"], "lineage": record})
        saved = recipe.checkpointer.save(recipe.checkpointed_state(), info)
        recipe.checkpointer.finalize()
    except BaseException:
        if getattr(recipe, "checkpointer", None) is not None:
            recipe.checkpointer.finalize(failed=True)
        if fresh and out.is_dir() and not scan_checkpoints(out):
            shutil.rmtree(out, ignore_errors=True)  # the folder this import made, with nothing in it
        elif not scan_checkpoints(out):
            written.unlink(missing_ok=True)
        raise
    for key, value in added.items():
        print(f"{written}: {key} = {value} (the source's)", flush=True)
    print(f"Imported {run.kind} as {saved} (step {counters['step']}, epoch {counters['epoch']}, "
          f"{counters['consumed_samples']} samples consumed); continue with: ckpt-train {written}", flush=True)
    return 0


def source_limits(cfg: Any) -> Any:
    """How large the source's files may be (``interop.source.Limits``): from the recipe's model, built on the meta
    device (no weights; a model of another package's builder is built whole), its parameters and buffers counted."""
    from automodel_ckpt.config.instantiate import instantiate
    from automodel_ckpt.interop.source import Limits
    from automodel_ckpt.models.materialize import builds_on_meta

    model = instantiate(cfg.model, "model", **({"on_meta": True} if builds_on_meta(cfg.model) else {}))
    return Limits(sum(t.numel() for t in model.state_dict().values()))
