"""`ckpt-train eval SRC --tasks T1,T2`: lm-evaluation-harness on a checkpoint, export folder, archive or run folder."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import UserError


def build_parser() -> VerbParser:
    p = VerbParser("eval", "Score a checkpoint (read from its shards, any world size; LoRA merged), an export folder, "
                           "an archive or each checkpoint of a run folder with lm-evaluation-harness tasks.")
    p.add_argument("src", type=Path, help="checkpoint, export folder, archive (ckpt-train pack) or run folder")
    p.add_argument("--tasks", default=None, help="comma-separated harness tasks, e.g. addition (shipped) or a task "
                                                 "of lm-evaluation-harness (required)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=32, help="documents per batch (default 32)")
    p.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    p.add_argument("--include-path", type=Path, default=None, help="a folder of your own harness task definitions "
                                                                   "(YAML), beside the shipped ones")
    p.add_argument("--only", default=None, help="comma-separated checkpoint names of the run folder SRC")
    p.add_argument("--log-samples", action="store_true", help="keep each document's prompt, answer and score in the "
                                                              "results file")
    p.add_argument("--no-track", action="store_true", help="do not log the scores to the run's trackers (logging: "
                                                           "in the checkpoint's config.yaml)")
    p.add_argument("--track-outside-run", action="store_true", help="also log them to trackers the checkpoint's "
                   "config.yaml places outside the run folder (a log_dir elsewhere, an MLflow tracking_uri)")
    p.add_argument("--progress", action="store_true", help="show the harness's progress bars and messages")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tasks = tuple(t.strip() for t in (args.tasks or "").split(",") if t.strip())
    if not tasks:
        parser.error("the following arguments are required: --tasks")
    for name, value, least in (("--limit", args.limit, 1), ("--batch-size", args.batch_size, 1),
                               ("--num-fewshot", args.num_fewshot, 0)):
        if value is not None and value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("ckpt-train eval runs lm-evaluation-harness, which is not installed: pip install "
                        "'lm-eval==0.4.13' (or the package's [eval] extra)") from None
    from automodel_ckpt.evaluation.harness import (EvalSettings, evaluate, load_model, results_dir, scores, targets,
                                                   task_manager, write_results)
    from automodel_ckpt.evaluation.tracked import log_scores

    include = str(args.include_path.resolve()) if args.include_path is not None else None
    settings = EvalSettings(tasks, args.limit, args.batch_size, args.num_fewshot, include)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    chosen = targets(args.src, only)
    task_manager(tasks, include)  # an unknown task is refused before any model is read
    summary: list[tuple[str, dict[str, dict[str, float]]]] = []
    for src in chosen:
        from lm_eval.utils import make_table

        with load_model(src) as (model, tokenizer):
            results = evaluate(model, tokenizer, settings, quiet=not (args.progress or args.debug),
                               log_samples=args.log_samples)
        written = write_results(results, src, tasks)
        print(f"{src}:\n{make_table(results)}", flush=True)
        for path in written:
            print(f"results: {path}", flush=True)
        found = scores(results)
        if not args.no_track:  # the points at the checkpoint's step on its run's trackers
            for line in log_scores(results_dir(src), found, outside=args.track_outside_run):
                print(line, flush=True)
        summary.append((src.name, found))
    if len(summary) > 1:
        print(_summary_table(summary), flush=True)
    return 0


def _summary_table(summary: list[tuple[str, dict[str, dict[str, float]]]]) -> str:
    """One row per checkpoint, one column per task metric."""
    columns = sorted({(task, metric) for _, s in summary for task, metrics in s.items() for metric in metrics})
    head = ["checkpoint", *(f"{t}/{m}" for t, m in columns)]
    rows = [[name, *(f"{s.get(t, {}).get(m, float('nan')):.4f}" for t, m in columns)] for name, s in summary]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [head, *rows])
