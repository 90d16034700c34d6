"""Opt-in: vLLM serves the int8 (w8a8) export of a trained checkpoint with the bf16 export's greedy answers.

Skipped unless ``RUN_VLLM=1`` with vLLM in its own interpreter (``VLLM_PYTHON``, as test_vllm_interop.py; vLLM's CPU
build runs compressed-tensors W8A8 int8 on AVX2, W4A16 needs AVX-512). The checkpoint is ``VLLM_CHECKPOINT`` (one of
the default recipe), else the default recipe is trained here. On held-out addition problems, vLLM's answers from
the w8a8 folder (dynamic activation scales, and static ones from 64 validation examples) equal transformers' answers
from the bf16 export on at least 98% of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.harness import default_recipe_checkpoint
from tests.integration.test_vllm_interop import VLLM_PYTHON, _vllm_ready

REPO = Path(__file__).resolve().parents[2]
N = 100

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not _vllm_ready(), reason="set RUN_VLLM=1 with vLLM installed at VLLM_PYTHON")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return default_recipe_checkpoint(os.environ.get("VLLM_CHECKPOINT"), tmp_path_factory.mktemp("vllm_int8_run"))


@pytest.mark.parametrize("calibrate", [0, 64], ids=["dynamic", "static-64"])
def test_vllm_answers_from_w8a8_as_transformers_from_bf16(checkpoint, tmp_path, calibrate):
    sys.path.insert(0, str(REPO / "examples"))
    from evaluation import generate_answers
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.export.plan import consolidate, resolve_model_dir
    from automodel_ckpt.data.builtin import heldout_examples
    from automodel_ckpt.models.tiny import build_tokenizer

    prompts = [p for p, _ in heldout_examples(N)]
    export = consolidate(resolve_model_dir(checkpoint), tmp_path / "export", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    expected = generate_answers(reference, build_tokenizer(), prompts)
    int8 = tmp_path / "w8a8"
    subprocess.run([sys.executable, "-m", "automodel_ckpt", "export", str(checkpoint), "--to", "int8", "--out",
                    str(int8), "--no-progress", "--calibrate", str(calibrate),
                    *(["--recipe", str(REPO / "recipes" / "tiny_llama_sft.yaml")] if calibrate else [])], check=True, capture_output=True,
                   timeout=600)
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"} | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([VLLM_PYTHON, str(Path(__file__).with_name("vllm_answers.py")), str(int8),
                           json.dumps(prompts), "8"], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("VLLM_OUTPUT ")).split(" ", 1)[1])
    same = sum(a == b for a, b in zip(got, expected)) / N
    assert same >= 0.98, (same, list(zip(got, expected))[:10])
