"""The recipe contract (``__init__(cfg)``, ``run()``) and the one copy of the run's wiring around training."""

from __future__ import annotations

import functools
import gc
import warnings
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from automodel_ckpt.checkpoint import (AutoInterval, Checkpointer, CheckpointConfig, PreemptionWatcher, discover_state,
                                       run_folder)
from automodel_ckpt.config.loader import to_yaml
from automodel_ckpt.distributed.env import DistEnv, init_distributed
from automodel_ckpt.recipes.stages import StageElsewhere
from automodel_ckpt.tracking import RunObserver, advise
from automodel_ckpt.training.rng import seed_everything
from automodel_ckpt.training.step_scheduler import SaveInterval


class BaseRecipe:
    """What `ckpt-train` runs: ``recipe: my_pkg.MyRecipe`` in the YAML names a subclass (docs/custom-recipes.md).

    Every rank constructs it with the validated config (cheap: no process group yet) and calls ``run()`` once,
    which returns with the last checkpoint complete. A subclass writes ``setup`` (``setup_distributed()`` first,
    ``build_checkpointer()`` last) and ``step``, or overrides ``train`` for a loop of its own. Every public
    attribute with ``state_dict`` and ``load_state_dict`` is checkpointed under its name, but
    ``checkpoint_exclude``."""

    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset()
    checkpointer: Checkpointer  # built by ``build_checkpointer`` at the end of setup
    env: DistEnv  # the process group (``setup_distributed``)
    step_scheduler: Any  # the steps to train (``training.step_scheduler.StepScheduler``), built in setup
    restored: Any = None  # what the last restore_checkpoint loaded (``checkpoint.Restored``)
    _preemption: PreemptionWatcher | None = None  # installed by ``run`` before ``setup``
    _observer: RunObserver | None = None  # the trackers and the cost log (``build_checkpointer``)
    #: Whether the recipe runs in stages (docs/stages.md): its loop stops where a stage ends, its restore begins one.
    takes_stages: ClassVar[bool] = False
    _lineage: dict[str, Any] | None = None  # what each checkpoint records of where the run came from (rank 0)
    _report: Any = None  # logging.report's LiveReport (rank 0)

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.checkpoint_config: CheckpointConfig = CheckpointConfig.from_section(cfg.checkpoint)

    def run(self) -> None:
        """Train to the end or until preempted (a launch per stage), the last save complete on return."""
        if type(self).setup is BaseRecipe.setup:  # neither this template's steps nor a run of its own
            raise NotImplementedError(f"{type(self).__name__} must implement setup() and step(), or run()")
        from automodel_ckpt.config.stages import StagePlan

        plan = StagePlan.of(self.cfg)
        if plan is None:
            self.run_launch()
            return
        from automodel_ckpt.recipes.stages import run_in_stages

        run_in_stages(self, plan)

    def run_launch(self) -> int | None:
        """Setup, restore, train, end. Returns the step the run goes on from in another stage's recipe, else None."""
        with PreemptionWatcher.for_run(self.checkpoint_config) as self._preemption:  # a signal during setup counts
            try:
                self.setup()
                try:
                    restored = self.restore_checkpoint()
                except StageElsewhere as elsewhere:  # a checkpoint of another stage: the run built again for it
                    self.finalize_checkpoints()
                    return elsewhere.step
                steps = self.step_scheduler
                if steps.done:
                    print(f"Training already complete at step {steps.step} (max {steps.total_steps}); nothing to do",
                          flush=True)
                    self.finalize_checkpoints()  # a run that ends: its folder lock and node-local steps go
                    return None
                gc.set_threshold(700, 10, 10)  # Python's pace for the steps (``cli.main`` slowed it for the start)
                self._observer.start(steps.step, restored, every_steps=self.cfg.step_scheduler.ckpt_every_steps,
                                     mtbf_hours=self.checkpoint_config.mtbf_hours,
                                     world_size=self.env.world_size, tier=self.restored.tier,
                                     load_seconds=round(self.restored.seconds, 3) if restored else None)
                ended = self.train()
                self.finalize_checkpoints()  # async: the last checkpoint is published
                stopped = ended is not None and ended.stop
                line = self._observer.end(steps.step, "preempted" if stopped else "complete")
                if self._report is not None:
                    self._report.close()  # the page of the launch's end
                if self.env.is_main and line:
                    print(line, flush=True)
                if self.env.is_main and stopped:
                    print(f"Preempted by {self._preemption.name} at step {steps.step}: saved {ended.saved}; rerun the "
                          "same command to resume", flush=True)
                return steps.step if getattr(steps, "stage_ends", False) and not stopped else None
            except BaseException as exc:
                if self._observer is not None:
                    self._observer.fail()
                if hasattr(self, "checkpointer"):  # unless setup failed before building it: nothing to let end
                    # background writes end, nothing half-written published; the last step kept where it may be
                    self.checkpointer.finalize(failed=True, save_last=getattr(exc, "save_last_step", False))
                raise

    @property
    def observer(self) -> RunObserver | None:
        """The run's trackers and cost log (``build_checkpointer``): a loop of its own logs its records here."""
        return self._observer

    def setup(self) -> None:
        """``setup_distributed()``, the state (model, optimizer, ``step_scheduler``, ...), ``build_checkpointer()``."""
        raise NotImplementedError(f"{type(self).__name__} must implement setup()")

    def setup_distributed(self) -> DistEnv:
        """The process group (``distributed:``), then every random stream seeded (``seed``)."""
        self.env = init_distributed(self.cfg.distributed.backend, self.cfg.distributed.timeout_minutes)
        seed_everything(self.cfg.seed)
        return self.env

    def build_checkpointer(self, **options: Any) -> Checkpointer:
        """The run's observer (trackers, cost log) and ``self.checkpointer``; ``options`` are the Checkpointer's."""
        config_yaml = to_yaml(self.cfg)  # as each checkpoint's config.yaml: also the trackers' hyper-parameters
        self._observer = RunObserver(self.cfg.logging, run_folder(self.checkpoint_config), is_main=self.env.is_main,
                                     config_yaml=config_yaml)
        if self._observer.tracker.requested:
            self.tracking = self._observer.tracker  # checkpointed: a resume reopens the same tracked runs
        if self.cfg.logging.get("report") and self.env.is_main:  # the run's page, rewritten off the training thread
            from automodel_ckpt.report import LiveReport

            self._report = LiveReport(run_folder(self.checkpoint_config))
            self._observer.on_checkpoint = self._report.request
            print(f"Report: {self._report.path} (rewritten at each checkpoint; logging.report)", flush=True)
        options.setdefault("lineage", self.lineage_record)
        observer = self._observer
        auto = functools.partial(  # Young/Daly's interval from the costs measured as saves run
            AutoInterval, lambda cost_s, mtbf_s, step_s: advise(cost_s, mtbf_s, step_s).interval_steps,
            mtbf_hours=self.checkpoint_config.mtbf_hours, observed_mtbf_s=observer.observed_mtbf_s,
            is_main=self.env.is_main, say=options.get("say", print), note=observer.interval)
        if self.cfg.step_scheduler.get("ckpt_every_steps") == "auto":
            options.setdefault("interval", auto())
        local = self.checkpoint_config.local
        if local.every_steps == "auto" and self.checkpoint_config.enabled:  # the node-local tier's, the same way
            steps = self.step_scheduler
            schedule = SaveInterval(local.min_every_steps, local.max_every_steps, lambda: steps.total_steps)
            self.step_scheduler.local_interval = schedule  # checkpointed with the step counters
            options.setdefault("local_interval", auto(schedule=schedule))
        self.checkpointer = Checkpointer(self.checkpoint_config, self.env, resolved_config_yaml=config_yaml,
                                         preemption=self._preemption, observer=self._observer, **options)
        return self.checkpointer

    def train(self) -> Any:
        """``step()`` to the end or until preempted, logged and saved when due; the last ``StepEnded``."""
        steps, ended = self.step_scheduler, None
        while not steps.done:
            record = self.step()
            self._observer.log_train(record)
            if self.env.is_main:
                print(record, flush=True)
            ended = self.checkpointer.step_end(self.checkpointed_state, steps, epoch=steps.epoch, loss=record["loss"])
            if ended.stop:
                break  # preempted: saved, and the run stops
        return ended

    def step(self) -> dict[str, Any]:
        """One optimizer step, ``step_scheduler.record_step`` included; its record (``step``, ``loss``, ...)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def checkpointed_state(self) -> dict[str, Any]:
        return discover_state(self, exclude=self.checkpoint_exclude)

    def finalize_checkpoints(self) -> Path | None:
        """Complete the checkpoint still being written in the background (``checkpoint.is_async``), if any."""
        return self.checkpointer.finalize()

    def lineage_record(self, restored: Path | None) -> dict[str, Any]:
        """This run's parents (base model, restored checkpoint, data): what each of its checkpoints records."""
        from automodel_ckpt.export import data_identity, training_lineage

        model = self.cfg.get("model")
        data = getattr(getattr(self, "dataloader", None), "data", None)
        try:
            self._lineage = training_lineage(model.get("pretrained_model_name_or_path") if model is not None else None,
                                             restored, self.cfg.checkpoint.get("restore_from"),
                                             run_folder(self.checkpoint_config), data_identity(self.cfg, data))
        except Exception as exc:  # noqa: BLE001 - lineage is a record beside the run: one warning, never its end
            text = f"lineage: not recorded ({type(exc).__name__}: {exc})"
            warnings.warn(text, stacklevel=2)
            self._lineage = {"parents": [], "not_recorded": text[:1000]}
        return self._lineage  # (a run in stages adds the stage it is in once its restore knows it: recipes.stages)

    def restore_checkpoint(self) -> Path | None:
        """Restore what ``checkpoint.restore_from`` selects; ``self.restored`` says what it loaded."""
        self.restored = self.checkpointer.resume(self.checkpointed_state())
        return self.restored.path
