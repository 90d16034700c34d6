"""`ckpt-train RECIPE.yaml`: validate the recipe, then train in-process or under torch's elastic agent."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn


def main(argv: list[str], forked: Callable[[str, list[str]], None] | None = None) -> int:
    """Validate the recipe here, then train in-process or under the elastic agent (whose forked workers run
    ``forked``: ``cli.forked_worker``)."""
    from automodel_ckpt.checkpoint import CheckpointConfig
    from automodel_ckpt.config.loader import to_yaml
    from automodel_ckpt.cli.common import check_recipe, load_recipe
    from automodel_ckpt.distributed.env import inside_launcher_worker
    from automodel_ckpt.launch import launch_agent, parse_launch_args, preload

    opts, recipe_path, overrides = parse_launch_args(argv)
    if inside_launcher_worker():
        return run_worker(recipe_path, overrides)
    if opts.debug:
        os.environ["AUTOMODEL_CKPT_DEBUG"] = "1"
    cfg = load_recipe(recipe_path, overrides)
    huge_pages_if_sharded(cfg, opts.world_size)  # before this process's first tensor; its workers inherit it
    mesh, inputs = check_recipe(cfg, opts.world_size, fetchable=opts.dry_run)
    if opts.dry_run:
        from automodel_ckpt.config.validate import check_parallel_plans

        inputs += check_parallel_plans(cfg, mesh)
        print(to_yaml(cfg), end="")
        for line in inputs:
            print(f"# {line}", file=sys.stderr)
        print(f"# valid for {opts.world_size} process(es) ({mesh.describe()}); --dry-run: not training",
              file=sys.stderr)
        return 0
    ckpt = CheckpointConfig.from_section(cfg.checkpoint)
    if ckpt.enabled and opts.nnodes == 1:  # another run has the folder: one line now, before a model is loaded
        from automodel_ckpt.checkpoint import run_folder, RunLock

        RunLock(run_folder(ckpt)).refuse_if_held()  # the run takes the lock itself (Checkpointer), on rank 0
    fetch_models(cfg)  # a Hub model missing from the cache: downloaded once per node, before any worker starts
    if opts.needs_agent:
        if opts.start_method == "fork":
            preload(str(cfg.recipe), (("peft",) if cfg.get("peft") else ()) + family_module(cfg.model))
        preemption = ckpt.preemption_signal if ckpt.enabled else None
        return launch_agent(opts, recipe_path, overrides, preemption_signal=preemption, forked=forked)
    return run_worker(recipe_path, overrides)


def huge_pages_if_sharded(cfg, world_size: int) -> None:
    """torch's huge pages for tensors where the recipe surely shards the model (``dp_shard: full``, tensor, pipeline
    or expert parallelism, HSDP): a sharded model's pinned thresholds fault them in 2 MiB at a time, while a model that
    fits keeps its freed blocks and huge pages would only cost it time. From the config alone, before the checks (they
    import model code, which makes tensors)."""
    from automodel_ckpt.distributed import data_parallel
    from automodel_ckpt.distributed.allocator import huge_pages_for_tensors
    from automodel_ckpt.distributed.mesh import resolve_sizes
    from automodel_ckpt.errors import ConfigError

    try:
        setting, meshed = data_parallel.check(cfg.distributed.get("dp_shard"), resolve_sizes(cfg.distributed,
                                                                                              world_size))
    except ConfigError:  # check_recipe says it in one line
        return
    if setting == "full" or meshed:
        huge_pages_for_tensors()


def fetch_models(cfg) -> None:
    """Download a Hub model (and tokenizer) missing from the Hugging Face cache, once per node, in the launcher (workers
    started by torchrun or srun fetch it themselves before the process group exists: ``models.hub``)."""
    from automodel_ckpt.models.hub import is_hub_id, model_folder

    model = cfg.model
    name = model.get("pretrained_model_name_or_path")
    if name and model.get("config") is None and not model.get("embedded") and is_hub_id(str(name)):
        model_folder(str(name))
    tok = cfg.tokenizer.pretrained_model_name_or_path
    if tok and is_hub_id(str(tok)):
        model_folder(str(tok), "tokenizer.pretrained_model_name_or_path", weights=False)


def family_module(model: Any) -> tuple[str, ...]:
    """The modeling module of the model's family where the launcher can tell it without building anything (the
    recipe's ``model.config``, a local folder's config): imported once before the fork, not by every worker."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from automodel_ckpt.models.build import DEFAULT_MODEL_TYPE, local_model_path

    try:
        config = model.get("config")
        if config is None:
            folder = local_model_path(model.get("pretrained_model_name_or_path"))
            if folder is None:
                return ()
            config = PretrainedConfig.get_config_dict(str(folder))[0]
        name = model_type_to_module_name(config.get("model_type", DEFAULT_MODEL_TYPE))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # the worker says what is wrong, if anything
        return ()
    return (f"transformers.models.{name}.modeling_{name}",)


def run_worker(recipe_path: str, overrides: list[str]) -> NoReturn:
    """Train in this process (one rank of the job): ``cls(cfg).run()`` of the recipe class the config names. A finished
    run ends the process through ``end_process`` (torch's C++ threads must not meet teardown); a failure raises."""
    from automodel_ckpt.config.instantiate import locate
    from automodel_ckpt.cli.common import check_recipe, load_recipe
    from automodel_ckpt.distributed.allocator import return_freed_memory
    from automodel_ckpt.distributed.env import end_process, shutdown_distributed
    from automodel_ckpt.distributed.lifeline import children_die_with_this_process

    children_die_with_this_process()  # its DataLoader workers end the moment this rank ends, however it ends
    return_freed_memory()  # freed tensors go back to the OS instead of staying on glibc's heap (unless user-set)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_recipe(recipe_path, overrides)
    huge_pages_if_sharded(cfg, world_size)  # a worker started by torchrun: before its first tensor
    check_recipe(cfg, world_size, inputs=False)
    fetch_models(cfg)  # started by ckpt-train: already there; by torchrun or srun: one process per cache downloads
    locate(cfg.recipe, "recipe")(cfg).run()
    shutdown_distributed()
    end_process(0)
