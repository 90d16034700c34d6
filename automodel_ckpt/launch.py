"""Starts training: in-process for one process, or torch's elastic agent (torchrun) for several or many nodes."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from automodel_ckpt.distributed.lifeline import mark_launcher, proc_stat
from automodel_ckpt.errors import USER_ERROR_EXIT_CODES, ConfigError, expect

#: The launcher's folder where each worker also leaves its error line (``cli.common.report``).
ERRORS_FOLDER = "AUTOMODEL_CKPT_ERRORS"


def default_start_method() -> str:
    """``fork`` on Linux without GPUs (a GPU driver initialised before a fork is unusable), else ``exec``."""
    gpu = any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))
    return "fork" if sys.platform.startswith("linux") and not gpu else "exec"


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0  # torch's elastic agent restarts failed workers this many times (they resume by themselves)
    # fork: workers start from the launcher's imports; exec: each is a new `python -m automodel_ckpt`
    start_method: str = field(default_factory=default_start_method)
    debug: bool = False
    dry_run: bool = False
    extra: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def needs_agent(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes > 1 or self.max_restarts > 0


_INT_FLAGS = {"nproc_per_node", "nnodes", "node_rank", "master_port", "max_restarts"}
_FLAGS = _INT_FLAGS | {"master_addr", "rdzv_endpoint", "start_method"}
START_METHODS = ("fork", "exec")


def parse_launch_args(argv: list[str]) -> tuple[LaunchOptions, str, list[str]]:
    """Split ``[launcher flags] RECIPE.yaml [--key value ...]`` into its three parts."""
    opts = LaunchOptions()
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        if token in ("--debug", "--dry-run"):
            setattr(opts, token[2:].replace("-", "_"), True)
            i += 1
        elif _flag_key(token) in _FLAGS:
            i = _set_flag(argv, i, opts)
        else:
            raise ConfigError(f"unknown launcher flag '{token}' (launcher flags go before the recipe; "
                              "config overrides like --a.b value go after it)")
    if i >= len(argv):
        raise ConfigError("missing recipe: ckpt-train [launcher flags] RECIPE.yaml [--key value ...]")
    recipe, rest = argv[i], argv[i + 1:]
    for flag in ("--debug", "--dry-run"):
        if flag in rest:
            setattr(opts, flag[2:].replace("-", "_"), True)
            rest = [a for a in rest if a != flag]
    rest = _launcher_flags_after_recipe(rest, opts)
    expect(opts.nproc_per_node >= 1, "--nproc-per-node", "at least 1", opts.nproc_per_node)
    expect(opts.nnodes >= 1, "--nnodes", "at least 1", opts.nnodes)
    expect(opts.max_restarts >= 0, "--max-restarts", "0 or more", opts.max_restarts)
    methods = f"one of {', '.join(START_METHODS)}"
    expect(opts.start_method in START_METHODS, "--start-method", methods, opts.start_method)
    expect(0 <= opts.node_rank < opts.nnodes, "--node-rank", f"0..{opts.nnodes - 1}", opts.node_rank)
    if opts.nnodes > 1 and not (opts.rdzv_endpoint or opts.master_addr):
        raise ConfigError("--nnodes > 1 needs --master-addr/--master-port or --rdzv-endpoint HOST:PORT")
    return opts, recipe, rest


def _flag_key(token: str) -> str:
    return token.partition("=")[0].lstrip("-").replace("-", "_")


def _set_flag(argv: list[str], i: int, opts: LaunchOptions) -> int:
    """Set the launcher flag ``argv[i]`` (``--name value`` or ``--name=value``); the index after it."""
    name, eq, value = argv[i].partition("=")
    if not eq:
        if i + 1 >= len(argv):
            raise ConfigError(f"{name} needs a value")
        value, i = argv[i + 1], i + 1
    key = _flag_key(name)
    try:
        setattr(opts, key, int(value) if key in _INT_FLAGS else value)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got '{value}'") from None
    return i + 1


def _launcher_flags_after_recipe(rest: list[str], opts: LaunchOptions) -> list[str]:
    """Take launcher flags written after the recipe (``--nproc-per-node=2``): no config key has their names."""
    out: list[str] = []
    i = 0
    while i < len(rest):
        name, eq, _ = rest[i].partition("=")
        if name.startswith("--") and _flag_key(name) in _FLAGS:
            i = _set_flag(rest, i, opts)
            continue
        step = 1 if eq or not name.startswith("--") else 2  # an override: its value (without `=`) is never a flag
        out.extend(rest[i:i + step])
        i += step
    return out


def torchrun_args(opts: LaunchOptions, recipe: str, overrides: list[str]) -> list[str]:
    """Arguments for ``torch.distributed.run`` whose workers run ``python -m automodel_ckpt`` on the same recipe."""
    args = ["--nproc-per-node", str(opts.nproc_per_node), "--nnodes", str(opts.nnodes)]
    if opts.max_restarts:
        args += ["--max-restarts", str(opts.max_restarts)]
    if opts.rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--rdzv-id", os.environ.get("SLURM_JOB_ID", "automodel-ckpt")]
    elif opts.master_addr or opts.master_port or opts.nnodes > 1:
        args += ["--node-rank", str(opts.node_rank), "--master-addr", opts.master_addr or "127.0.0.1",
                 "--master-port", str(opts.master_port or 29500)]
    else:
        args += ["--standalone"]
    return args + ["-m", "automodel_ckpt", recipe, *overrides]


def launch_agent(opts: LaunchOptions, recipe: str, overrides: list[str], *,
                 preemption_signal: str | None = None, forked: Callable[[str, list[str]], None] | None = None) -> int:
    """Run torch's elastic agent in this process; return the workers' exit code.

    ``preemption_signal`` is forwarded to the workers, which save at their next step and exit 0 (torch's agent would
    stop them and fail, as it still does on a second signal). ``forked``: what a forked worker runs."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // opts.nproc_per_node))
    if opts.debug:
        os.environ["AUTOMODEL_CKPT_DEBUG"] = "1"
    if opts.max_restarts:  # restarted workers rendezvous on a store of their own: torch's shared rendezvous store
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # keeps the failed attempt's addresses
    mark_launcher()  # the workers end when this process ends, however it ends (distributed/lifeline.py)
    quiet_failed_worker_logs()
    errors = tempfile.mkdtemp(prefix="ckpt-train-errors-")
    os.environ[ERRORS_FOLDER] = errors  # each worker leaves its error line there (cli.common.report)
    args = get_args_parser().parse_args(torchrun_args(opts, recipe, overrides))
    forwarder = SignalForwarder(preemption_signal) if preemption_signal else None
    if forwarder is not None and hasattr(args, "signals_to_handle"):  # the agent leaves this signal to us
        handled = [s.strip() for s in str(args.signals_to_handle).split(",") if s.strip()]
        args.signals_to_handle = ",".join(s for s in handled if s != forwarder.signal.name) or "SIGINT"
        forwarder.install()
    try:
        if opts.start_method == "fork" and forked is not None:
            _run_forking(args, forked, recipe, overrides)
        else:
            run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        rank = failure_origin(errors, rank)
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        for line in other_ranks_errors(errors):
            print(line, file=sys.stderr, flush=True)
        print(f"error: training failed on rank {rank} (exit code {failure.exitcode}); see its message above",
              file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"error: stopped by {exc.sigval.name}; the workers were terminated", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        if forwarder is not None:
            forwarder.uninstall()
        os.environ.pop(ERRORS_FOLDER, None)
        shutil.rmtree(errors, ignore_errors=True)
    return 0


def failure_origin(folder: str, rank: int) -> int:
    """The rank whose failure ``rank`` raised again (left by ``cli.common.report``), else the lowest rank of this node
    that left the same error: the rank that failed, not whichever of the ranks meeting its error exited first."""
    left = _left(folder)
    origin = left.get(f"origin-{rank}", "")
    if origin.isdigit():
        return int(origin)
    own = left.get(f"rank-{rank}")
    return min((int(name[5:]) for name, text in left.items() if name.startswith("rank-") and text == own), default=rank)


def other_ranks_errors(folder: str, limit: int = 1 << 16) -> list[str]:
    """The error lines of this node's workers other than rank 0 (which printed its own), each once, with its rank."""
    lines: dict[str, int] = {}
    left = _left(folder, limit)
    for rank in sorted(int(name[5:]) for name in left if name.startswith("rank-")):
        for line in left[f"rank-{rank}"].splitlines():
            lines.setdefault(line, rank)
    return [f"[rank {rank}] {line}" for line, rank in lines.items() if rank != 0]


def _left(folder: str, limit: int = 1 << 16) -> dict[str, str]:
    """What the workers left in ``folder`` (``rank-R``: error lines, ``origin-R``: where the error began), by name."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            kind, _, rank = name.partition("-")
            if kind in ("rank", "origin") and rank.isdigit():
                with contextlib.suppress(OSError), open(os.path.join(folder, name), encoding="utf-8",
                                                        errors="replace") as f:
                    found[name] = f.read(limit)
    return found


def _run_forking(args, entrypoint: Callable[[str, list[str]], None], recipe: str, overrides: list[str]) -> None:
    """torch's ``run(args)`` with the workers forked from this process, their imports already done (``preload``)."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # what torch's run() does for --standalone: a rendezvous of its own on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    args.start_method = "fork"
    config, _, _ = config_from_args(args)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the imports out of the workers' garbage collections (neither scanned again nor copied)
    elastic_launch(config=config, entrypoint=entrypoint)(recipe, list(overrides))


#: torch's loggers that report a failed worker (``failed (exitcode: N) local_rank: ...``) and the ending of the others
ELASTIC_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                   "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.multiprocessing.spawn")


def quiet_failed_worker_logs() -> None:
    """Install ``failed_worker_filter`` on torch's elastic loggers (once)."""
    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        if failed_worker_filter not in logger.filters:
            logger.addFilter(failed_worker_filter)


def failed_worker_filter(record: logging.LogRecord) -> bool:
    """Drop torch's ``failed (exitcode: N)`` record of a worker that printed our one-line error (else no traceback),
    and its ``Terminating process PID`` of each rank still running when one failed: the launcher's last line names
    the rank that failed."""
    if str(record.msg).startswith("Terminating process"):
        return False
    if not str(record.msg).startswith("failed (exitcode"):
        return True
    code = record.args[0] if isinstance(record.args, tuple) and record.args else None
    if isinstance(code, int) and not isinstance(code, bool) and code in USER_ERROR_EXIT_CODES:
        return False
    record.exc_info, record.exc_text = None, None
    return True


#: What the modeling module of every transformers family imports first (``models/llama/modeling_llama.py``, ...).
_FAMILY_SHARED = ("transformers.generation.utils", "transformers.masking_utils", "transformers.modeling_layers",
                  "transformers.modeling_rope_utils", "transformers.cache_utils", "transformers.integrations")


def preload(recipe_target: str, extra: tuple[str, ...] = ()) -> None:
    """Import in the launcher what every forked worker imports first: the recipe's module if it is the package's
    (a user's module runs in the workers only), DCP, transformers' model classes and what every family's modeling
    module imports, its table of weight renamings, and ``extra``."""
    import importlib

    module = recipe_target.rpartition(".")[0] if ":" not in recipe_target else ""
    if not module.startswith("automodel_ckpt."):
        module = "automodel_ckpt.recipes.llm_finetune"
    for name in (module, "torch.distributed.checkpoint", "automodel_ckpt.checkpoint.checkpointer",
                 "transformers.modeling_utils", "transformers.models.auto.modeling_auto", *_FAMILY_SHARED, *extra):
        with contextlib.suppress(ImportError):  # the worker reports a recipe it cannot import, in one line
            importlib.import_module(name)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")  # builds (once) the table of every family's weight renamings


class SignalForwarder:
    """Forwards the preemption signal to the workers (each in a session of its own), once."""

    def __init__(self, signal_name: str) -> None:
        import signal

        self.signal = signal.Signals[signal_name]
        self.received = 0
        self._previous = None

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signal, self._handle)

    def uninstall(self) -> None:
        import signal

        if self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.received += 1
        workers = worker_pids(os.getpid())
        if self.received > 1 or not workers:  # again, or nothing to forward to yet: stop the way torch does
            raise SignalException(f"Process {os.getpid()} got signal: {self.signal.name}", sigval=self.signal)
        print(f"Received {self.signal.name}: the workers save a checkpoint at their next step and stop",
              file=sys.stderr, flush=True)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def worker_pids(parent: int) -> list[int]:
    """The launcher ``parent``'s workers: its children running ``automodel_ckpt`` or its own command line."""
    found = []
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            own = f.read()
    except OSError:
        own = None
    try:
        entries = os.listdir("/proc")
    except OSError:
        entries = []
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = proc_stat(entry)
        try:
            if fields is None or int(fields[1]) != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if b"automodel_ckpt" in cmdline or cmdline == own:  # started as `-m automodel_ckpt`, or forked
            found.append(int(entry))
    return sorted(found)  # none without /proc: the signal then stops the job as torch does
