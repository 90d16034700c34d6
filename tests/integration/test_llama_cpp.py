"""Opt-in: llama.cpp itself runs our GGUF export of a trained checkpoint, as transformers runs its bf16 export.

Skipped unless ``RUN_LLAMA_CPP=1``; then ``tools/llama_cpp.sh`` fetches llama.cpp's Debian binaries (pinned, with
checksums) into its cache, and the test skips with that script's one line where they cannot be had. The checkpoint
is ``LLAMA_CPP_CHECKPOINT`` (a checkpoint of the default recipe), else the default recipe is trained here (about
900 steps: minutes on a CPU). ``llama-completion`` answers held-out addition problems from the q8_0 export: its
exact-match is at least 0.98x that of transformers on the bf16 export; ``llama-perplexity`` runs on the problems'
text, q8_0 within 5% of the bf16 GGUF's perplexity in llama.cpp.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.harness import default_recipe_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "llama_cpp.sh"
N = 200

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.environ.get("RUN_LLAMA_CPP") != "1", reason="set RUN_LLAMA_CPP=1 to run llama.cpp")]


@pytest.fixture(scope="module")
def llama_cpp() -> Path:
    done = subprocess.run(["bash", str(SCRIPT), "fetch"], capture_output=True, text=True, timeout=900)
    if done.returncode:
        pytest.skip((done.stderr.strip().splitlines() or ["llama.cpp unavailable"])[-1])
    return SCRIPT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return default_recipe_checkpoint(os.environ.get("LLAMA_CPP_CHECKPOINT"), tmp_path_factory.mktemp("llama_cpp_run"))


def _export(checkpoint: Path, out: Path, type_name: str) -> Path:
    subprocess.run([sys.executable, "-m", "automodel_ckpt", "export", str(checkpoint), "--type", type_name, "--out",
                    str(out), "--no-progress"], check=True, capture_output=True, timeout=600)
    return out


def _complete(script: Path, gguf: Path, prompt: str) -> str:
    """llama-completion's greedy answer. llama.cpp 0.7.0 (Debian) now and then exits 0 before it loads the prompt,
    printing nothing (about 1 run in 5 on the development machine, in the same way with or without our loader or a
    terminal): such a run is tried again, up to 5 times."""
    for _ in range(5):
        done = subprocess.run(["bash", str(script), "llama-completion", "-m", str(gguf), "-p", prompt, "-n", "6",
                               "--temp", "0", "-no-cnv", "--no-display-prompt", "--simple-io", "-t", "1"],
                              capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL)
        if done.stdout.strip():
            return done.stdout.strip().split(" ")[0]  # up to " [end of text]"
        if "error loading model" in done.stderr:
            raise AssertionError(done.stderr[-2000:])
    raise AssertionError(f"llama-completion printed nothing 5 times for {prompt!r}: {done.stderr[-2000:]}")


def test_llama_completion_and_perplexity(llama_cpp, checkpoint, tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    from evaluation import generate_answers
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.export.plan import consolidate, resolve_model_dir
    from automodel_ckpt.data.builtin import heldout_examples
    from automodel_ckpt.models.tiny import build_tokenizer

    examples = heldout_examples(N)
    export = consolidate(resolve_model_dir(checkpoint), tmp_path / "export", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # the bf16 weights
    bf16 = sum(a == w for a, (_, w) in zip(generate_answers(reference, build_tokenizer(), [p for p, _ in examples]),
                                           examples)) / N
    q8 = _export(checkpoint, tmp_path / "q8_0.gguf", "q8_0")
    answers = [_complete(llama_cpp, q8, prompt) for prompt, _ in examples]
    exact = sum(a == w for a, (_, w) in zip(answers, examples)) / N
    assert bf16 > 0.5, f"the checkpoint has not learned the task (bf16 exact-match {bf16})"
    assert exact >= 0.98 * bf16, (exact, bf16, answers[:10])

    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(p + a for p, a in examples) * 4)
    ppl = {}
    for type_name in ("bf16", "q8_0"):
        gguf = q8 if type_name == "q8_0" else _export(checkpoint, tmp_path / "bf16.gguf", "bf16")
        done = subprocess.run(["bash", str(llama_cpp), "llama-perplexity", "-m", str(gguf), "-f", str(text), "-c", "64",
                               "-b", "64", "-t", "1"], capture_output=True, text=True, timeout=600)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
        assert done.returncode == 0 and m, done.stderr[-2000:]
        ppl[type_name] = float(m.group(1))
    assert ppl["q8_0"] <= 1.05 * ppl["bf16"], ppl


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "gemma2", "starcoder2",
                                    "gemma3_text", "qwen2_moe", "qwen3_moe"])
def test_every_family_loads_and_generates_in_llama_cpp(llama_cpp, family, tmp_path):
    """Each family's GGUF (q8_0) loads in llama.cpp and generates; its tokenizer gives our tokenizer's ids."""
    from automodel_ckpt.models.tiny import build_tokenizer, ensure_tiny_base
    from tests.unit.export.test_gguf_export import FAMILIES, _family_base

    base = ensure_tiny_base(tmp_path / "base") if family == "llama" else _family_base(family, tmp_path / "base")
    gguf = _export(base, tmp_path / "m.gguf", "q8_0")
    for _ in range(5):  # see _complete: a run that ends before loading the prompt is tried again
        done = subprocess.run(["bash", str(llama_cpp), "llama-completion", "-m", str(gguf), "-p", "12+34=", "-n", "4",
                               "--temp", "0", "-no-cnv", "--simple-io", "-t", "1", "--ignore-eos"],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0 and "error loading model" not in done.stderr, done.stderr[-2000:]
        if "eval time" in done.stderr:
            break
    assert "eval time" in done.stderr and "12+34=" in done.stdout, done.stderr[-2000:]  # 4 tokens generated
    done = subprocess.run(["bash", str(llama_cpp), "llama-tokenize", "-m", str(gguf), "-p", "12+34= 46", "--ids",
                           "--log-disable"], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == str(build_tokenizer()("12+34= 46").input_ids)
    assert family == "llama" or family in FAMILIES


def _perplexity(script: Path, text: Path, *model: str) -> float:
    done = subprocess.run(["bash", str(script), "llama-perplexity", *model, "-f", str(text), "-c", "64", "-b", "64",
                           "-t", "1"], capture_output=True, text=True, timeout=600)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    assert done.returncode == 0 and m, done.stderr[-2000:]
    return float(m.group(1))


def test_gguf_lora_adapter_applies_as_the_merged_export(llama_cpp, tmp_path):
    """`--adapter`: llama.cpp with the base's GGUF and the adapter (``--lora``) gives the merged export's
    perplexity (to within the merge's bf16 rounding), far from the base's own."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.ondisk.formats import peft as peft_format
    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.data.builtin import heldout_examples
    from automodel_ckpt.models.lora import apply_lora
    from automodel_ckpt.models.tiny import ensure_tiny_base

    base = ensure_tiny_base(tmp_path / "base")
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), PeftConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        peft_format.save_adapter(model, tmp_path / "ckpt" / "model", rank=0, base_model_path=base)
    finally:
        if started:
            dist.destroy_process_group()
    checkpoint = tmp_path / "ckpt"
    subprocess.run([sys.executable, "-m", "automodel_ckpt", "export", str(checkpoint), "--adapter", "--type", "f16",
                    "--out", str(tmp_path / "lora.gguf")], check=True, capture_output=True, timeout=600)
    merged = _export(checkpoint, tmp_path / "merged.gguf", "f16")
    plain = _export(base, tmp_path / "base.gguf", "f16")
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(p + a for p, a in heldout_examples(200)) * 4)
    with_lora = _perplexity(llama_cpp, text, "-m", str(plain), "--lora", str(tmp_path / "lora.gguf"))
    assert abs(with_lora / _perplexity(llama_cpp, text, "-m", str(merged)) - 1) < 0.01
    assert abs(with_lora / _perplexity(llama_cpp, text, "-m", str(plain)) - 1) > 0.05
