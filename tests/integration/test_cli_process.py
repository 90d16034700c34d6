"""Process-level checks of the command line and of signal handling: the real executables, in subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "tiny_llama_sft.yaml")


def test_no_traceback_from_the_real_command(tmp_path):
    exe = Path(sys.executable).parent / "ckpt-train"
    proc = subprocess.run([str(exe), RECIPE, "--step_scheduler.max_stepz", "3"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "Traceback" not in proc.stderr


def test_a_command_that_loaded_torch_runs_its_exit_handlers_and_skips_the_teardown(tmp_path):
    """The process's own command (here a verb failing on a missing folder, torch loaded) keeps its exit status and
    its output, runs its exit handlers, and leaves without the interpreter's teardown (an object that only the
    teardown would collect is never finalized): a second or more of CPU saved at every exit."""
    script = ("import atexit, sys, torch\n"
              "from automodel_ckpt.cli import main\n"
              "class Collected:\n"
              "    def __del__(self):\n"
              "        print('torn down', flush=True)\n"
              "kept = Collected()\n"
              "atexit.register(print, 'exit handler ran')\n"
              "sys.argv = ['ckpt-train', 'inspect', 'no_such_folder']\n"
              "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert proc.stdout.splitlines() == ["exit handler ran"]  # and never 'torn down'
    listed = subprocess.run([sys.executable, "-c", script.replace("sys.argv = ", "sys.argv = ['ckpt-train']; x = ")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert listed.stdout.splitlines()[-2:] == ["exit handler ran", "torn down"]  # usage alone: the teardown runs


def test_a_second_signal_stops_a_single_process(tmp_path):
    """Without the launcher, the first signal asks for a save; a second one is the signal's default action."""
    script = (
        "import os, signal\n"
        "from automodel_ckpt.checkpoint import PreemptionWatcher\n"
        "w = PreemptionWatcher('SIGTERM', repeat_stops=True); w.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); print('requested', w.requested, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM); print('still alive', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["requested True"]
    assert proc.returncode == -signal.SIGTERM


def test_a_bug_in_a_forked_worker_prints_its_traceback(tmp_path, assets):
    """Bad input is one line; an exception that is not is the worker's own traceback (marked with its rank), as an
    exec'd worker's interpreter prints it, before the launcher's line naming the rank."""
    from tests.integration.harness import ckpt_train

    (tmp_path / "user_data.py").write_text("def broken(**kwargs):\n    raise AttributeError('no such column here')\n")
    result = ckpt_train(tmp_path, assets, "--dataset._target_", "user_data.broken", "--checkpoint.enabled", "false",
                        nproc=2, launcher=("--start-method", "fork"), env={"PYTHONPATH": str(tmp_path)}, check=False)
    assert result.returncode == 1, result.output[-3000:]
    assert "[rank0]: Traceback (most recent call last):" in result.stderr
    assert "[rank0]: AttributeError: no such column here" in result.stderr
    assert "error: training failed on rank 0 (exit code 1); see its message above" in result.stderr


def test_bad_input_met_on_rank_0_while_the_others_wait_is_one_line_and_no_rank_prints_a_traceback(tmp_path, assets):
    """Rank 0 prepares the data first while the other ranks wait for it: its failure reaches them as the same error
    (printed once), not as the broken collective of a rank that exited (a gloo traceback on every other rank)."""
    from tests.integration.harness import ckpt_train

    result = ckpt_train(tmp_path, assets, "--data.val_size", "100000", "--checkpoint.enabled", "false", nproc=2,
                        check=False)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "rank" in line]
    assert len(errors) == 2 and "leaves no training data" in errors[0], result.stderr[-3000:]
    assert errors[1] == "error: training failed on rank 0 (exit code 2); see its message above"
    assert "Traceback" not in result.stderr and "gloo" not in result.stderr


def test_forked_workers_start_with_what_building_a_model_imports():
    """What the launcher imports before forking saves every worker the same imports: after ``preload`` a family's
    modeling module adds only itself and its config, and transformers' weight-renaming table is already built.
    Validating a recipe (its learning-rate schedules among the targets) imports neither PEFT nor the Trainer's
    utilities (a second of every launch, through ``transformers.optimization``)."""
    script = (
        "import json, sys\n"
        "from automodel_ckpt.launch import preload\n"
        "preload('automodel_ckpt.recipes.llm_finetune.FinetuneRecipe')\n"
        "import automodel_ckpt.config.validate, automodel_ckpt.training.lr\n"
        "print('heavy', [m for m in ('peft', 'transformers.trainer_utils') if m in sys.modules])\n"
        "import transformers.conversion_mapping as cm\n"
        "print('table', cm._checkpoint_conversion_mapping_cache is not None)\n"
        "before = set(sys.modules)\n"
        "import transformers.models.qwen2.modeling_qwen2\n"
        "print('new', json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "heavy []", lines[0]
    assert lines[1] == "table True"
    new = json.loads(lines[2].removeprefix("new "))
    assert all(name.startswith("transformers.models.qwen2") for name in new), new


def test_the_launcher_preloads_the_family_it_can_tell_without_building_the_model(tmp_path):
    """``family_module``: the recipe's model family from ``model.config`` or a local folder's config.json, imported
    before the fork (every worker would import it); nothing where it cannot tell, and the worker reports the rest."""
    from omegaconf import OmegaConf

    from automodel_ckpt.cli.train import family_module

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    assert family_module(OmegaConf.create({"config": {"hidden_size": 8}})) == \
        ("transformers.models.llama.modeling_llama",)  # what the builder defaults to
    assert family_module(OmegaConf.create({"pretrained_model_name_or_path": str(tmp_path)})) == \
        ("transformers.models.qwen2.modeling_qwen2",)
    (tmp_path / "config.json").write_text("{not json")
    for model in ({"pretrained_model_name_or_path": str(tmp_path)}, {"pretrained_model_name_or_path": "/no/such"},
                  {"config": {"model_type": 7}}):
        assert family_module(OmegaConf.create(model)) == ()


def test_inspect_and_verify_of_a_run_folder_never_import_torch(straight_runs):
    """Reading a run folder (JSON, manifests, checksums, safetensors headers) needs no torch: the verbs answer in a
    fraction of a second instead of the seconds torch's import takes."""
    run = straight_runs.get(2)
    script = (
        "import sys\n"
        "from automodel_ckpt.cli import main\n"
        f"codes = [main(['inspect', {str(run)!r}]), main(['verify', {str(run)!r}]),\n"
        f"         main(['verify', {str(run / 'epoch_0_step_8')!r}])]\n"
        "print('codes', codes, 'torch', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "codes [0, 0, 0] torch False", proc.stdout[-3000:]


def test_a_command_starts_with_a_slower_garbage_collector_and_its_workers_step_at_pythons(tmp_path, assets):
    """``ckpt-train`` scans its start's long-lived objects less often (imports and builds: a quarter of importing
    torch and transformers), the launcher freezes its imports out of the workers' collections before it forks them,
    and each worker steps at Python's own pace."""
    from tests.integration.harness import ckpt_train

    script = "import gc\nfrom automodel_ckpt.cli import main\nmain(['--version'])\nprint(gc.get_threshold())\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.stdout.splitlines()[-1] == "(10000, 10, 10)", proc.stdout + proc.stderr
    (tmp_path / "pace_recipe.py").write_text(
        "import gc, json, os\n"
        "from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe\n"
        "class PaceRecipe(FinetuneRecipe):\n"
        "    def train_step(self, micro):\n"
        "        out = os.path.join(os.environ['PACE_OUT'], f'rank{self.env.rank}.json')\n"
        "        if not os.path.exists(out):\n"
        "            with open(out, 'w') as f:\n"
        "                json.dump({'threshold': gc.get_threshold(), 'frozen': gc.get_freeze_count()}, f)\n"
        "        return super().train_step(micro)\n")
    ckpt_train(tmp_path, assets, "--recipe", "pace_recipe.PaceRecipe", "--checkpoint.enabled", "false",
               "--step_scheduler.max_steps", "1", nproc=2, env={"PYTHONPATH": str(tmp_path), "PACE_OUT": str(tmp_path)})
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["threshold"] == [700, 10, 10], seen
        assert seen["frozen"] > 100_000, seen  # torch, transformers and the package, imported before the fork
