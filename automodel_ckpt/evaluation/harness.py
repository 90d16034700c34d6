"""`ckpt-train eval`: a checkpoint's model built from its own tensors, scored by lm-evaluation-harness's HF model class.

The tensors are read from the shards (``tensors.open_tensors``) into a private temporary Hugging Face folder (never
the checkpoint's ``consolidated/``, which may be stale or absent) that transformers loads with safetensors only and
no remote code, once the config's model, built on the meta device, is known to be no larger than its files. Results:
the harness's table, and each task's JSON in ``eval/<task>.json`` beside what was evaluated. docs/evaluation.md.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from automodel_ckpt.errors import CheckpointError, UserError, first_line
from automodel_ckpt.evaluation.folder import write_folder
from automodel_ckpt.evaluation.tasks import TASKS_DIR
from automodel_ckpt.evaluation.tensors import open_tensors
from automodel_ckpt.ondisk import (Archive, CheckpointFolder, HFFolder, add_files_to_manifest, is_plain_name,
                                   scan_checkpoints, write_atomic)

__all__ = ["EvalSettings", "evaluate", "load_model", "results_dir", "scores", "targets", "task_manager",
           "write_results"]


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...]
    limit: int | None = None
    batch_size: int = 32
    num_fewshot: int | None = None
    include_path: str | None = None  # a folder of the user's own task definitions, beside the shipped ones


def targets(src: Path, only: list[str] | None = None) -> list[Path]:
    """What to evaluate: ``src`` itself, or a run folder's checkpoints (all, or the ones ``only`` names)."""
    src = Path(src)
    if not src.exists():
        raise UserError(f"'{src}' does not exist; give a checkpoint, an export folder, an archive or a run folder")
    records = scan_checkpoints(src) if src.is_dir() and not _is_model_folder(src) else []
    if not records:
        if only:
            raise UserError(f"--only names checkpoints of a run folder; '{src}' is not one")
        return [src]
    if only:
        by_name = {r.name: r.path for r in records}
        unknown = [n for n in only if n not in by_name]
        if unknown:
            raise UserError(f"--only: no checkpoint '{unknown[0]}' in '{src}' (there: {', '.join(by_name)})")
        return [by_name[n] for n in only]
    return [r.path for r in records]


def _is_model_folder(path: Path) -> bool:
    """A checkpoint or a model folder of one (not a run folder holding checkpoints)."""
    ckpt, hf = CheckpointFolder(path), HFFolder(path)
    return any(p.exists() for p in (ckpt.metadata, hf.config, hf.adapter_config, ckpt.model.path))


def results_dir(src: Path) -> Path:
    """The folder whose ``eval/`` holds ``src``'s results: a checkpoint (also when its ``model/`` is given), an
    export folder, or beside an archive."""
    src = Path(src)
    if src.is_file():
        return Archive(src).eval
    if src.name == CheckpointFolder.model and CheckpointFolder(src.parent).metadata.is_file():
        return src.parent
    return src


@functools.lru_cache(maxsize=4)
def task_manager(tasks: tuple[str, ...], include_path: str | None = None) -> Any:
    """The harness's task index: the shipped tasks (and those of ``include_path``, a folder of task YAML files)
    alone when they are all asked for (no scan of the registry), else the registry with them (seconds: thousands of
    task files). An unknown task is one line naming the ones shipped. Built once per set of tasks."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"include path '{include_path}' is not a folder of task definitions")
    local = [str(TASKS_DIR), *([str(include_path)] if include_path is not None else [])]
    manager = TaskManager(include_path=local, include_defaults=False)
    if all(t in manager.all_tasks for t in tasks):
        return manager
    manager = TaskManager(include_path=local)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        shipped = ", ".join(TaskManager(include_path=str(TASKS_DIR), include_defaults=False).all_tasks)
        raise UserError(f"--tasks: unknown task '{unknown[0]}'; shipped: {shipped}, or a task of lm-evaluation-harness "
                        "(`lm-eval ls tasks`)")
    return manager


@contextmanager
def load_model(src: Path) -> Iterator[tuple[Any, Any]]:
    """``(model, tokenizer)`` of ``src`` in transformers, built from its tensors through a temporary folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open_tensors(src, adapters_as_adapters=False) as tensors, \
            tempfile.TemporaryDirectory(prefix="ckpt-eval-") as tmp:
        if not any(name in tensors.side for name in HFFolder.TOKENIZER_FILES):
            raise CheckpointError(f"'{src}' carries no tokenizer files; evaluate an export folder that has them")
        folder = Path(tmp) / "model"
        entries = [(name, tensors.shapes[name], tensors.dtypes[name]) for name in tensors.shapes]
        write_folder(folder, entries, tensors.read, tensors.side)
        _check_config_fits(folder, sum(math.prod(shape) for _, shape, _ in entries))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", use_safetensors=True,
                                                     trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        model.eval()
        model.name_or_path = str(src)
        yield model, tokenizer


def _check_config_fits(folder: Path, numel: int) -> None:
    """The config's model, built on the meta device, holds at most the parameters the files hold."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    wanted = sum(p.numel() for p in model.parameters())
    if wanted > numel:
        raise CheckpointError(f"the config of '{folder}' describes a model of {wanted} parameters, its files hold "
                              f"{numel}; the config does not fit the weights")


def evaluate(model: Any, tokenizer: Any, settings: EvalSettings, *, quiet: bool = True,
             log_samples: bool = False) -> dict[str, Any]:
    """The harness's results of ``settings.tasks`` on ``model`` (its own ``simple_evaluate`` on its ``HFLM``);
    ``quiet``: its progress bars and the messages of the programs it runs (``git describe``) are not shown."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(settings.tasks, settings.include_path)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    try:
        with _stderr_closed() if quiet else nullcontext(), _env_report_once():
            results = simple_evaluate(model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                                      limit=settings.limit, task_manager=manager, log_samples=log_samples)
    except Exception as exc:  # the harness's own failure (a registry task's dataset offline, ...): one line
        raise UserError(f"lm-evaluation-harness failed on {', '.join(settings.tasks)}: {type(exc).__name__}: "
                        f"{first_line(exc)} (--debug shows where)") from exc
    if results is None:
        raise UserError("lm-evaluation-harness returned no results")
    return results


_ENV_REPORT: dict[str, Any] = {}  # the harness's environment report, gathered once per process


@contextmanager
def _env_report_once() -> Iterator[None]:
    """The harness's own environment report (torch's ``collect_env``: seconds of subprocesses) gathered at the
    first evaluation of the process and reused by the next ones (an evaluation during training, a run folder)."""
    import lm_eval.evaluator as evaluator

    gather = evaluator.add_env_info

    def once(storage: dict[str, Any]) -> None:
        if not _ENV_REPORT:
            gather(_ENV_REPORT)
        storage.update(_ENV_REPORT)

    evaluator.add_env_info = once
    try:
        yield
    finally:
        evaluator.add_env_info = gather


@contextmanager
def _stderr_closed() -> Iterator[None]:
    """File descriptor 2 to /dev/null meanwhile (the harness's bars and its subprocesses write there directly);
    an exception still reaches the caller, after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def write_results(results: dict[str, Any], src: Path, tasks: tuple[str, ...]) -> list[Path]:
    """The harness's results JSON of each task (only that task's entries; the answers under ``samples`` when logged)
    in ``eval/<task>.json`` beside ``src``, in a checkpoint's manifest (``verify`` stays clean)."""
    from lm_eval.utils import handle_non_serializable

    owner = results_dir(src)
    written = []
    for task in tasks:
        if not is_plain_name(task):
            raise UserError(f"--tasks: '{task}' cannot name a results file")
        one = {key: ({k: v for k, v in value.items() if k == task} if isinstance(value, dict) and task in value
                     else value) for key, value in results.items()}
        one["source"] = str(src)
        path = CheckpointFolder(owner).eval_results(task)
        if path.parent.is_symlink() or (path.parent.exists() and not path.parent.is_dir()):
            raise CheckpointError(f"'{path.parent}' is a symlink or a file, not a folder; results are never written "
                                  "through a link: remove it and evaluate again")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(one, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
        write_atomic(path, text.encode("utf-8"))
        written.append(path)
    if written and Path(src).is_dir():
        add_files_to_manifest(written[0].parent)  # a checkpoint's (or its export's) manifest lists them
    return written


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of the harness's results (its ``metric,filter`` keys, stderr left out)."""
    return {task: {k.split(",")[0]: float(v) for k, v in values.items()
                   if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
            for task, values in results.get("results", {}).items()}
