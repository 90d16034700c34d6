"""Checks of a loaded recipe that its types cannot express, made before any process starts training."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from automodel_ckpt.checkpoint import CheckpointConfig
from automodel_ckpt.config.instantiate import TARGET_KEY, check_arguments, instantiate, locate
from automodel_ckpt.config.sections import present
from automodel_ckpt.distributed import data_parallel
from automodel_ckpt.distributed.mesh import (IMAGE_TEXT_EP_REFUSAL, IMAGE_TEXT_TP_REFUSAL, MeshSizes,
                                             resolve_pipeline, resolve_sizes)
from automodel_ckpt.errors import ConfigError, expect
from automodel_ckpt.training import compile

#: The package's image-text builder, whose models tensor parallelism does not split yet.
IMAGE_TEXT_BUILDER = "automodel_ckpt.models.build.build_image_text_model"


def positive(value: int | None, key: str, allow_none: bool = True) -> None:
    """``ConfigError`` unless ``value`` is a positive integer (or None, where ``allow_none``)."""
    if value is None and allow_none:
        return
    expect(value is not None and value >= 1, key, "a positive integer", value)


def check_batch_sizes(global_batch_size: int, local_batch_size: int, dp_size: int) -> int:
    """Gradient-accumulation steps that make ``global_batch_size`` from ``local_batch_size`` on ``dp_size`` ranks."""
    per_micro_step = local_batch_size * dp_size
    if global_batch_size % per_micro_step:
        raise ConfigError(
            f"step_scheduler.global_batch_size ({global_batch_size}) must be a multiple of local_batch_size × "
            f"data-parallel size ({local_batch_size} × {dp_size} = {per_micro_step}); change "
            "step_scheduler.global_batch_size or step_scheduler.local_batch_size")
    return global_batch_size // per_micro_step


def validate_config(cfg: DictConfig, world_size: int) -> MeshSizes:
    """Raise ConfigError (one line) for values that would fail later; the mesh the run will have."""
    sched = cfg.step_scheduler
    positive(sched.global_batch_size, "step_scheduler.global_batch_size", allow_none=False)
    positive(sched.local_batch_size, "step_scheduler.local_batch_size", allow_none=False)
    positive(sched.max_steps, "step_scheduler.max_steps")
    positive(sched.num_epochs, "step_scheduler.num_epochs", allow_none=False)
    every = sched.ckpt_every_steps
    expect(not (isinstance(every, str) and every != "auto" or isinstance(every, (bool, float))),
           "step_scheduler.ckpt_every_steps", "a positive integer or auto", every)
    positive(None if every == "auto" else every, "step_scheduler.ckpt_every_steps")
    positive(sched.get("min_every_steps", 1), "step_scheduler.min_every_steps", allow_none=False)
    positive(sched.get("max_every_steps"), "step_scheduler.max_every_steps")
    if sched.get("max_every_steps") is not None and sched.max_every_steps < sched.get("min_every_steps", 1):
        raise ConfigError(f"step_scheduler.max_every_steps: {sched.max_every_steps} is below min_every_steps "
                          f"({sched.min_every_steps})")
    positive(sched.val_every_steps, "step_scheduler.val_every_steps")
    sizes = resolve_sizes(cfg.distributed, world_size)  # one-line errors: sizes, unsupported strategies
    data_parallel.check(cfg.distributed.get("dp_shard"), sizes)
    compile.check(cfg.get("training", {}).get("compile", "auto"))
    check_batch_sizes(sched.global_batch_size, sched.local_batch_size, sizes.dp)
    seq_length = cfg.get("data", {}).get("seq_length")
    if sizes.sequence_parallel and isinstance(seq_length, int) and seq_length % sizes.tp:
        raise ConfigError(f"distributed.sequence_parallel: data.seq_length ({seq_length}) must be a multiple of "
                          f"tp_size ({sizes.tp}), each tensor-parallel rank holding seq_length / tp_size positions; "
                          "change data.seq_length")
    model = cfg.get("model")
    image_text = model is not None and model.get(TARGET_KEY) == IMAGE_TEXT_BUILDER
    for size, refusal in ((sizes.tp, IMAGE_TEXT_TP_REFUSAL), (sizes.ep, IMAGE_TEXT_EP_REFUSAL)):
        if size > 1 and image_text:
            raise ConfigError(refusal)
    if sizes.pp > 1:
        resolve_pipeline(cfg.distributed, sizes, sched.local_batch_size)
        if image_text:
            raise ConfigError("distributed.pp_size: pipeline parallelism for image-text models is not supported yet; "
                              "use pp_size 1")
    CheckpointConfig.from_section(cfg.checkpoint)  # validates itself (the recipe makes its own from the section)
    check_importable(cfg.recipe, "recipe")
    for section in ("model", "dataset", "validation_dataset", "optimizer", "lr_scheduler"):
        node = cfg.get(section)
        if node is not None and TARGET_KEY in node:
            check_arguments(node, section)  # unknown keys and wrong value types, before any process starts
    if model is not None and model.get("freeze") is not None:
        from automodel_ckpt.models.freeze import check_freeze_section

        check_freeze_section(model.get("freeze"))
    for section in present(cfg):  # an algorithm's section: its own checks (``config.sections``)
        if section.check is not None:
            section.check(cfg, sizes)
    if cfg.get("peft") is not None:
        from automodel_ckpt.models.lora import check_peft_section

        if sizes.tp > 1:
            raise ConfigError("distributed.tp_size: LoRA (a peft: section) with tensor parallelism is not supported "
                              "yet; use tp_size 1 (FSDP2 or HSDP shard the frozen base as well)")

        check_peft_section(cfg.peft)
    return sizes


def check_importable(path: str, key: str) -> None:
    """That ``path`` names an existing module or file, without importing it (the workers import it)."""
    import importlib.util

    if ":" in path:
        file = path.rsplit(":", 1)[0]
        if not Path(file).expanduser().exists():
            raise ConfigError(f"{key}: file '{file}' not found (from '{path}')")
        return
    module = path.rsplit(".", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        locate(path, key)  # raises the detailed error


def check_inputs_exist(cfg: DictConfig, *, fetchable: bool = False) -> list[str]:
    """Missing model or tokenizer paths before any process starts; one line per input saying where it lies."""
    from automodel_ckpt.models.build import check_model_source, no_folder_error
    from automodel_ckpt.models.hub import is_hub_id, model_source

    model = cfg.model
    lines = [check_model_source(model.get("pretrained_model_name_or_path"), model.get("config"), model.get("embedded"),
                                offline_ok=fetchable)]
    key = "tokenizer.pretrained_model_name_or_path"
    tok = cfg.tokenizer.pretrained_model_name_or_path
    if not tok and not model.get("pretrained_model_name_or_path"):  # a model.config build has no folder to read
        raise no_folder_error()
    if tok and not Path(tok).expanduser().exists():
        if not is_hub_id(tok):
            raise ConfigError(f"{key}: '{tok}' not found")
        source = model_source(tok, key, weights=False)
        if not fetchable:
            source.require_available()
        lines.append(f"{key} {source.describe()}")
    return lines


def check_parallel_plans(cfg: DictConfig, sizes: MeshSizes) -> list[str]:
    """``--dry-run`` with tensor, pipeline or expert parallelism: the plans checked on a meta-device model."""
    import contextlib
    import tempfile

    from omegaconf import OmegaConf

    from automodel_ckpt.models.materialize import builds_on_meta

    model = cfg.model
    if (sizes.tp == 1 and sizes.pp == 1 and sizes.ep == 1) or not builds_on_meta(model):
        return []
    with contextlib.ExitStack() as scratch:
        if model.get("config") is None:
            from automodel_ckpt.ondisk import HFFolder
            from automodel_ckpt.models.hub import CACHED, LOCAL, model_source

            name = str(model.get("pretrained_model_name_or_path") or "")
            if model.get("embedded") and not HFFolder(Path(name).expanduser()).config.is_file():
                model = OmegaConf.create(OmegaConf.to_container(model, resolve=True))
                folder = scratch.enter_context(tempfile.TemporaryDirectory(prefix="automodel-ckpt-dry-run-"))
                model.pretrained_model_name_or_path = str(Path(folder) / "base")
            elif not name or model_source(name).status not in (LOCAL, CACHED):
                return []
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # writing an embedded base's shards: not a dry run's output
        try:
            built = instantiate(model, "model", on_meta=True)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
    from automodel_ckpt.distributed.tensor_parallel import family_name, parallel_styles

    lines = []
    if sizes.tp > 1:
        parallel_styles(built, sizes.tp, sizes.sequence_parallel)  # the sequence-parallel entries too
        what = "tensor-parallel plan" + (" with sequence parallelism" if sizes.sequence_parallel else "")
        lines.append(f"model: the '{family_name(built)}' {what} applies on tp {sizes.tp}")
    if sizes.ep > 1:
        from automodel_ckpt.distributed.expert_parallel import DISPATCH, check_expert_parallel

        plan = check_expert_parallel(built, sizes.ep)
        experts = next(built.get_submodule(p).num_experts for p, s in plan.items() if s == DISPATCH)
        lines.append(f"model: the '{family_name(built)}' expert-parallel plan applies on ep {sizes.ep} "
                     f"({experts // sizes.ep} of {experts} experts per rank)")
    if sizes.pp > 1:
        from automodel_ckpt.distributed.pipeline import check_pipeline_model, decoder_layer_list, layer_span

        plan = check_pipeline_model(built, cfg.distributed, sizes, cfg.step_scheduler.local_batch_size)
        count = plan.stages(sizes.pp)
        stages = plan.stage_layers(len(decoder_layer_list(built)), count)
        lines.append(f"model: {count} pipeline stages of decoder layers "
                     + ", ".join(layer_span(r) for r in stages)
                     + f" ({plan.describe()})")
    return lines
