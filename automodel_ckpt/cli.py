"""The `ckpt-train` entry point: training (the default verb) and utility verbs, with one-line errors."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from typing import NoReturn

from automodel_ckpt import __version__
from automodel_ckpt.errors import UserError

USAGE = """\
usage: ckpt-train [launcher flags] RECIPE.yaml [--section.key value ...]
       ckpt-train consolidate CHECKPOINT [--out DIR] [--cast-dtype bf16|fp16|fp32|fp64] [--num-threads N]
       ckpt-train inspect CHECKPOINT_DIR [--json]
       ckpt-train merge-lora CHECKPOINT [--out DIR] [--base DIR]
       ckpt-train verify CHECKPOINT|CHECKPOINT_DIR [--quiet] [--sizes-only]
       ckpt-train plot CHECKPOINT_DIR [--out FILE.png]
       ckpt-train preview RECIPE.yaml [--num N] [--split train|validation] [--color] [--section.key value ...]

launcher flags:
  --nproc-per-node N       processes on this node (N > 1 starts torch's elastic agent)
  --nnodes N               number of nodes; with --node-rank R and --master-addr A --master-port P,
                           or --rdzv-endpoint HOST:PORT
  --debug                  show tracebacks instead of one-line errors
  --dry-run                check the recipe and overrides, print the resolved config, do not train

Any recipe key can be overridden after the recipe: --step_scheduler.max_steps 6 or --optimizer.lr=3e-4.
"""


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("AUTOMODEL_CKPT_DEBUG") == "1"


def _consolidate(argv: list[str]) -> int:
    from automodel_ckpt.checkpoint.consolidate_cli import main as consolidate_main

    return consolidate_main(argv)


def _inspect(argv: list[str]) -> int:
    from automodel_ckpt.checkpoint.inspect_cli import main as inspect_main

    return inspect_main(argv)


def _merge_lora(argv: list[str]) -> int:
    from automodel_ckpt.checkpoint.merge_lora import main as merge_lora_main

    return merge_lora_main(argv)


def _verify(argv: list[str]) -> int:
    from automodel_ckpt.checkpoint.verify_cli import main as verify_main

    return verify_main(argv)


def _plot(argv: list[str]) -> int:
    from automodel_ckpt.plot import main as plot_main

    return plot_main(argv)


def _preview(argv: list[str]) -> int:
    from automodel_ckpt.data.preview import main as preview_main

    return preview_main(argv)


VERBS = {"consolidate": _consolidate, "inspect": _inspect, "verify": _verify, "merge-lora": _merge_lora,
         "plot": _plot, "preview": _preview}


def _verb(argv: list[str]):
    return VERBS.get(argv[0]) if argv else None


def train(argv: list[str]) -> int:
    """Validate the recipe here, then train in-process or under the elastic agent."""
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import check_inputs_exist, validate_config
    from automodel_ckpt.distributed.env import inside_launcher_worker
    from automodel_ckpt.launch import launch_agent, parse_launch_args

    if inside_launcher_worker():
        opts, recipe_path, overrides = parse_launch_args(argv)
        return run_worker(recipe_path, overrides)
    opts, recipe_path, overrides = parse_launch_args(argv)
    if opts.debug:
        os.environ["AUTOMODEL_CKPT_DEBUG"] = "1"
    cfg = load_config(recipe_path, overrides, RecipeConfig)
    validate_config(cfg, opts.world_size)
    check_inputs_exist(cfg)
    if opts.dry_run:
        from automodel_ckpt.config.loader import to_yaml

        print(to_yaml(cfg), end="")
        print(f"# valid for {opts.world_size} process(es); --dry-run: not training", file=sys.stderr)
        return 0
    if opts.needs_agent:
        preemption = cfg.checkpoint.preemption_signal if cfg.checkpoint.enabled else None
        return launch_agent(opts, recipe_path, overrides, preemption_signal=preemption)
    return run_worker(recipe_path, overrides)


def run_worker(recipe_path: str, overrides: list[str]) -> NoReturn:
    """Train in this process (one rank of the job); after a finished run the process ends here, with status 0.

    A failure raises, and ``main`` reports it. Success ends the process through ``end_process``: torch's C++
    threads must not meet the interpreter's teardown (see there).
    """
    from automodel_ckpt.config.instantiate import locate
    from automodel_ckpt.config.loader import load_config
    from automodel_ckpt.config.schema import RecipeConfig
    from automodel_ckpt.config.validate import validate_config
    from automodel_ckpt.distributed.env import end_process, shutdown_distributed

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(recipe_path, overrides, RecipeConfig)
    validate_config(cfg, world_size)
    recipe_cls = locate(cfg.recipe, "recipe")
    recipe = recipe_cls(cfg)
    recipe.run()
    shutdown_distributed()
    end_process(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"ckpt-train {__version__}")
        return 0
    _quiet_third_party(debug)
    try:
        verb = _verb(argv)
        code = verb(argv[1:]) if verb is not None else train(argv)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        _report(f"error: {exc}")
        code = exc.exit_code
    except KeyboardInterrupt:
        _report("error: interrupted")
        code = 130
    if os.environ.get("WORLD_SIZE", "1") != "1" and code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip process-group teardown: the other ranks may be gone already
    return code


def _quiet_third_party(debug: bool) -> None:
    """One-line ``warning: ...`` messages, and no progress bars or advice from libraries we drive."""
    if debug:
        return
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Environment rather than API calls: the launcher then need not import these libraries, and the workers it
    # starts inherit the settings.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _report(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(prefix + message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
