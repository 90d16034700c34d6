"""tools/grpo_learns.py and tools/bench_grpo.py: what they refuse before any run, and where they run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_sampling_invariance_counts_no_difference_on_this_cpu_and_splits_every_row_once():
    tool = _module("sampling_invariance")
    assert [list(p) for p in tool.parts(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [list(p) for p in tool.parts(7, 7)] == [[i] for i in range(7)]
    prompts = tool.prompts_for(9, 64)
    assert len({len(p) for p in prompts}) > 1  # a split changes the left padding
    args = SimpleNamespace(device="cpu", dtype="float32", rows=5, max_new_tokens=3)
    result = tool.check("tiny-llama", args)
    assert result["rows"] == 5 and result["tokens"] > 5
    assert result["differing"] == {"2 parts": 0, "3 parts": 0, "one at a time": 0}
