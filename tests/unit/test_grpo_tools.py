"""tools/grpo_learns.py and tools/bench_grpo.py: what they refuse before any run, and where they run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_learns_refuses_a_folder_whose_runs_would_resume(tmp_path):
    (tmp_path / "grpo").mkdir()  # an earlier run's checkpoints: its GRPO would resume there, not start from SFT
    done = subprocess.run([sys.executable, str(TOOLS / "grpo_learns.py"), "--work", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("holds sft/ or grpo/ of an earlier run; give an empty or "
                                                          "new folder")


def test_bench_grpo_hides_the_gpus_from_a_cpu_run_and_checks_its_steps(tmp_path):
    bench = _module("bench_grpo")
    assert bench._devices("cpu") == {"CUDA_VISIBLE_DEVICES": ""}
    assert bench._devices("cuda") == {}
    done = subprocess.run([sys.executable, str(TOOLS / "bench_grpo.py"), "--steps", "3", "--warmup", "2", "--work",
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "--steps must exceed --warmup + 1" in done.stderr
