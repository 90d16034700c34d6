"""The `ckpt-train` entry point: training (the default verb) and the utility verbs, with one-line errors.

Each verb is one module of this package with ``main(argv) -> int``, registered in ``VERBS``; it parses with
``common.VerbParser`` and raises ``UserError``s, which ``run`` turns into ``error: ...`` and an exit code.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from gc import set_threshold as gc_threshold  # (``gc`` is a verb's module here)

from automodel_ckpt import __version__
from automodel_ckpt.cli.common import debug_requested, report
from automodel_ckpt.errors import UserError
from automodel_ckpt.shown import EscapingStream, one_line

# verb -> (module in this package, arguments as shown by --help)
VERBS: dict[str, tuple[str, str]] = {
    "consolidate": ("consolidate", "CHECKPOINT [--out DIR] [--cast-dtype bf16|fp16|fp32|fp64] [--num-threads N]"),
    "inspect": ("inspect", "CHECKPOINT_DIR|FILE.tar [--json] [--cost [--mtbf-hours H]]"),
    "merge-lora": ("merge_lora", "CHECKPOINT [--out DIR] [--base DIR]"),
    "export": ("export", "CHECKPOINT|EXPORT_DIR|FILE.tar --to TARGET [--out PATH] [--dry-run] [the target's options: "
                         "ckpt-train export --help]"),
    "pack": ("pack", "CHECKPOINT|EXPORT_DIR|ADAPTER_DIR [--out FILE.tar] [--cast-dtype DTYPE] [--no-progress]"),
    "verify": ("verify", "CHECKPOINT|CHECKPOINT_DIR|FILE.tar [--quiet] [--sizes-only] | --export CHECKPOINT"),
    "plot": ("plot", "CHECKPOINT_DIR [--out FILE.png]"),
    "report": ("run_report", "RUN_DIR [-o FILE.html]"),
    "env": ("env", ""),
    "gc": ("gc", "s3://BUCKET/RUN [--min-age-minutes M] [--dry-run]"),
    "preview": ("preview", "RECIPE.yaml [--num N] [--split train|validation] [--color] [--section.key value ...]"),
    "import": ("import_run", "SRC RECIPE.yaml --out RUN_DIR [--section.key value ...]"),
    "average": ("average", "CK1 CK2 ... | --last K RUN_DIR [--weights W1 W2 ...] --out DIR [--dtype DTYPE]"),
    "diff": ("diff", "A B [--tolerance T] [--json] [--all]"),
    "eval": ("eval", "CHECKPOINT|EXPORT_DIR|FILE.tar|RUN_DIR --tasks T1,T2 [--limit N] [--batch-size B] "
                     "[--num-fewshot K] [--only NAME,...]"),
}

_LAUNCHER_HELP = """
launcher flags:
  --nproc-per-node N       processes on this node (N > 1 starts torch's elastic agent)
  --nnodes N               number of nodes; with --node-rank R and --master-addr A --master-port P,
                           or --rdzv-endpoint HOST:PORT
  --max-restarts N         restart failed workers up to N times; they resume from the newest checkpoint
                           (the node-local tier's, with checkpoint.local.every_steps) by themselves
  --start-method fork|exec how workers start: forked from the launcher with its imports done (fork, the
                           default on Linux without GPUs: seconds faster, restarts too) or as new interpreters
                           (exec, the default with GPUs)
  --debug                  show tracebacks instead of one-line errors (every verb)
  --dry-run                check the recipe and overrides, print the resolved config, do not train

Any recipe key can be overridden after the recipe: --step_scheduler.max_steps 6 or --optimizer.lr=3e-4.
"""


def usage() -> str:
    lines = ["usage: ckpt-train [launcher flags] RECIPE.yaml [--section.key value ...]"]
    lines += [" ".join(filter(None, ("       ckpt-train", verb, args, "[--debug]")))
              for verb, (_, args) in VERBS.items()]
    return "\n".join(lines) + "\n" + _LAUNCHER_HELP


def verb_main(name: str) -> Callable[[list[str]], int]:
    """The ``main`` of verb ``name`` (imported on use: a verb's dependencies load only when it runs)."""
    module = importlib.import_module(f"automodel_ckpt.cli.{VERBS[name][0]}")
    return module.main


def main(argv: list[str] | None = None) -> int:
    from automodel_ckpt.distributed.lifeline import bind_to_launcher

    bind_to_launcher()  # a worker of the launcher (any verb): first thing, it ends when the launcher ends
    gc_threshold(10_000, 10, 10)  # the start's imports and builds scanned less often (-25% CPU; see recipes.base)
    own_command = argv is None  # the console script or ``python -m automodel_ckpt``, not a caller's list
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"ckpt-train {__version__}")
        return 0
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingStream(sys.stdout), EscapingStream(sys.stderr)  # names from folders: escaped
    try:
        if argv[0] in VERBS:
            code = run(verb_main(argv[0]), argv[1:])
        else:
            from automodel_ckpt.cli.train import main as train_main

            code = run(functools.partial(train_main, forked=forked_worker), argv)
        code = exit_code(code)
    finally:
        sys.stdout, sys.stderr = streams
    if own_command and "torch" in sys.modules:
        # the process's own command (the launcher, a verb): its exit handlers run, then it leaves without the
        # interpreter's teardown, a second or more of CPU once torch and transformers are loaded
        from automodel_ckpt.distributed.env import end_process

        end_process(code)
    return code


def forked_worker(recipe: str, overrides: list[str]) -> None:
    """A worker forked by the launcher, become what ``python -m automodel_ckpt RECIPE ...`` would be, then trained: a
    session of its own, a fresh process's signal handlers and streams, and the thread count the agent set."""
    import atexit
    import signal

    import torch

    from automodel_ckpt.distributed.env import return_on_success

    os.setsid()
    atexit._clear()  # the launcher's exit handlers are the launcher's
    return_on_success()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        code = main([recipe, *overrides])
    except Exception:  # a bug, not bad input: its traceback, as an exec'd worker's interpreter prints it
        sys.excepthook(*sys.exc_info())  # torch's, once the process group is up: every line marked [rankN]
        code = exit_code(1)
    if code:
        sys.exit(code)


def run(verb: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run one verb: a ``UserError`` becomes ``error: <one line>`` (the traceback too with --debug), and so does a
    ``MemoryError`` (exit code 1)."""
    debug = debug_requested(argv)
    quiet_third_party(debug)
    try:
        return verb(argv)
    except (UserError, MemoryError) as exc:
        if debug:
            traceback.print_exc()
        if isinstance(exc, UserError):
            report(f"error: {one_line(str(exc))}", origin=getattr(exc, "failed_rank", None))
            return exc.exit_code
        detail = f" ({one_line(str(exc))})" if str(exc) else ""
        report(f"error: this process could not allocate the memory it needed{detail}; free memory, or run it "
               "where there is more (--debug shows where)")
        return 1
    except KeyboardInterrupt:
        report("error: interrupted")
        return 130


def exit_code(code: int) -> int:
    """How a process ends with ``code``: a rank of a multi-process job never meets interpreter teardown (a finished one
    leaves through ``end_process``; a failed one at once, skipping process-group teardown: its peers may be gone)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return code
    if code == 0:
        from automodel_ckpt.distributed.env import end_process

        end_process(0)
    from automodel_ckpt.checkpoint import release_all_locks

    release_all_locks()  # the lock file too: a failed run leaves nothing behind in the folder
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_third_party(debug: bool) -> None:
    """One-line ``warning: ...`` messages, and no progress bars or advice from libraries we drive."""
    if debug:
        return
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {one_line(str(message))}\n"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Environment rather than API calls: the launcher then need not import these libraries, and the workers it
    # starts inherit the settings.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
