"""Starts training: in-process for one process, or torch's elastic agent (torchrun) for several or many nodes."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from automodel_ckpt.errors import ConfigError


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    debug: bool = False
    extra: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def needs_agent(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes > 1


_INT_FLAGS = {"nproc_per_node", "nnodes", "node_rank", "master_port"}
_FLAGS = _INT_FLAGS | {"master_addr", "rdzv_endpoint"}


def parse_launch_args(argv: list[str]) -> tuple[LaunchOptions, str, list[str]]:
    """Split ``[launcher flags] RECIPE.yaml [--key value ...]`` into its three parts."""
    opts = LaunchOptions()
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        if token == "--debug":
            opts.debug = True
            i += 1
            continue
        name, eq, value = token.lstrip("-").partition("=")
        key = name.replace("-", "_")
        if key not in _FLAGS:
            raise ConfigError(f"unknown launcher flag '{token}' (launcher flags go before the recipe; "
                              "config overrides like --a.b value go after it)")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"{token} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key in _INT_FLAGS:
            try:
                setattr(opts, key, int(value))
            except ValueError:
                raise ConfigError(f"--{name}: expected an integer, got '{value}'") from None
        else:
            setattr(opts, key, value)
    if i >= len(argv):
        raise ConfigError("missing recipe: ckpt-train [launcher flags] RECIPE.yaml [--key value ...]")
    recipe, rest = argv[i], argv[i + 1:]
    if "--debug" in rest:
        opts.debug = True
        rest = [a for a in rest if a != "--debug"]
    if opts.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: expected at least 1, got {opts.nproc_per_node}")
    if opts.nnodes < 1:
        raise ConfigError(f"--nnodes: expected at least 1, got {opts.nnodes}")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise ConfigError(f"--node-rank: expected 0..{opts.nnodes - 1}, got {opts.node_rank}")
    if opts.nnodes > 1 and not (opts.rdzv_endpoint or opts.master_addr):
        raise ConfigError("--nnodes > 1 needs --master-addr/--master-port or --rdzv-endpoint HOST:PORT")
    return opts, recipe, rest


def torchrun_args(opts: LaunchOptions, recipe: str, overrides: list[str]) -> list[str]:
    """Arguments for ``torch.distributed.run`` whose workers run ``python -m automodel_ckpt`` on the same recipe."""
    args = ["--nproc-per-node", str(opts.nproc_per_node), "--nnodes", str(opts.nnodes)]
    if opts.rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--rdzv-id", os.environ.get("SLURM_JOB_ID", "automodel-ckpt")]
    elif opts.master_addr or opts.master_port or opts.nnodes > 1:
        args += ["--node-rank", str(opts.node_rank), "--master-addr", opts.master_addr or "127.0.0.1",
                 "--master-port", str(opts.master_port or 29500)]
    else:
        args += ["--standalone"]
    return args + ["-m", "automodel_ckpt", recipe, *overrides]


def launch_agent(opts: LaunchOptions, recipe: str, overrides: list[str]) -> int:
    """Run torch's elastic agent in this process; return the workers' exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // opts.nproc_per_node))
    if opts.debug:
        os.environ["AUTOMODEL_CKPT_DEBUG"] = "1"
    args = get_args_parser().parse_args(torchrun_args(opts, recipe, overrides))
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"error: training failed on rank {rank} (exit code {failure.exitcode}); see its message above",
              file=sys.stderr, flush=True)
        return code
    return 0
