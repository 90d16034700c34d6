"""Quantized exports: what they cost to make and what they cost in quality (docs/benchmarks.md, "Quantized exports").

Usage: python tools/bench_export.py CHECKPOINT [--base-gb 1] [--n 200] [--out results.json]

Speed and memory: every ``ckpt-train export`` (GGUF bf16, f16, q8_0, q4_0; int8 w8a8, w4a16) runs as its own
process, on CHECKPOINT and on a synthetic Llama base of about ``--base-gb`` GB of bf16 weights (built from a config,
saved with ``save_pretrained``); each reports its wall time, the source bytes read per second and its peak resident
memory (the kernel's count for the child).

Quality, on CHECKPOINT (a checkpoint of the default recipe: the two-digit addition task): exact-match of greedy
answers on ``--n`` held-out problems, and the perplexity of the answers (answer and end-of-sequence given the
prompt), for the bf16 Hugging Face export in transformers, each GGUF in llama.cpp itself (``tools/llama_cpp.sh``:
``llama-server`` answers, ``llama-perplexity`` on the problems' text) when it can be had, each GGUF read back by
transformers' GGUF reader (dequantized weights), and each int8 folder in transformers' compressed-tensors loader
(dequantized weights: activations are not quantized there; vLLM's own numbers come from the opt-in vLLM test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
CKPT_TRAIN = [sys.executable, "-m", "automodel_ckpt"]
LLAMA_CPP = REPO / "tools" / "llama_cpp.sh"
GGUF_TYPES = ("bf16", "f16", "q8_0", "q4_0")
INT8_SCHEMES = ("w8a8", "w4a16")


def run_export(src: Path, out: Path, args: list[str]) -> dict[str, float]:
    """One export in its own process: the export's own seconds (as it reports them: planning and writing, without
    the interpreter's start), the process's wall seconds and its peak resident memory in MiB.

    The peak is the child's ``VmHWM``, read until it exits: ``ru_maxrss`` would not do, Linux carries a forked
    parent's high-water mark across ``exec``."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([*CKPT_TRAIN, "export", str(src), "--out", str(out), "--no-progress", *args],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        peak = 0
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak = max(peak, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)))
            except (OSError, AttributeError):
                pass
            time.sleep(0.02)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    if proc.returncode:
        raise SystemExit(f"export failed: {output[-2000:]}")
    m = re.search(r"written to .*, ([0-9.]+) s\)", output)
    return {"seconds": float(m.group(1)) if m else wall, "wall": wall, "peak_mib": peak / 1024}


def source_bytes(src: Path) -> int:
    from automodel_ckpt.export import open_model

    with open_model(src) as source:
        return sum(math.prod(s) * source.dtypes[n].itemsize for n, s in source.shapes.items())


def speed(src: Path, work: Path, label: str) -> list[dict[str, object]]:
    nbytes = source_bytes(src)
    rows = []
    for kind, value in [("gguf", t) for t in GGUF_TYPES] + [("int8", s) for s in INT8_SCHEMES]:
        out = work / (re.sub(r"\W+", "-", label) + f"-{value}" + (".gguf" if kind == "gguf" else ""))
        flag = ["--to", kind, "--type" if kind == "gguf" else "--scheme", value]
        measured = run_export(src, out, flag)
        size = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.iterdir())
        rows.append({"source": label, "format": f"{kind} {value}", "source_bytes": nbytes, "out_bytes": size,
                     "seconds": measured["seconds"], "process_seconds": measured["wall"],
                     "gb_per_s": nbytes / max(measured["seconds"], 1e-3) / 1e9, "peak_mib": measured["peak_mib"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def synthetic_base(folder: Path, gb: float) -> Path:
    """A Llama of about ``gb`` GB of bf16 weights, with the embedded tokenizer (vocabulary padded to 128 rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.models.tiny import build_tokenizer

    hidden = 2048
    layers = max(1, round(gb * 1e9 / 2 / (16 * hidden * hidden)))  # 4 h^2 attention + 3 h (4h) MLP per layer
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


# --- quality -----------------------------------------------------------------------------------------------------
def answers_and_perplexity(model: torch.nn.Module, examples: list[tuple[str, str]]) -> tuple[float, float]:
    from evaluation import generate_answers

    from automodel_ckpt.models.tiny import build_tokenizer

    tok = build_tokenizer()
    got = generate_answers(model, tok, [p for p, _ in examples])
    exact = sum(a == w for a, (_, w) in zip(got, examples)) / len(examples)
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, answer in examples:
            head = tok(prompt).input_ids
            ids = torch.tensor([head + tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]])
            logits = model(ids).logits[0, len(head) - 1:-1]
            nll += torch.nn.functional.cross_entropy(logits.float(), ids[0, len(head):], reduction="sum").item()
            count += ids.shape[1] - len(head)
    return exact, math.exp(nll / count)


def transformers_quality(folder: Path, examples: list[tuple[str, str]], **kwargs: object) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    return answers_and_perplexity(model, examples)


def llama_cpp_quality(gguf: Path, examples: list[tuple[str, str]], text: Path) -> tuple[float, float] | None:
    """Exact-match from llama-server's greedy answers and llama-perplexity's PPL; None where llama.cpp is missing."""
    if subprocess.run(["bash", str(LLAMA_CPP), "fetch"], capture_output=True).returncode:
        return None
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen(["bash", str(LLAMA_CPP), "llama-server", "-m", str(gguf), "--port", str(port), "-c",
                               "64", "-np", "1", "-t", "2", "--log-disable"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):  # the server's load: a few seconds at most
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        right = 0
        for prompt, answer in examples:
            body = json.dumps({"prompt": prompt, "n_predict": 6, "temperature": 0, "cache_prompt": False}).encode()
            req = urllib.request.Request(f"{base}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                right += json.loads(r.read())["content"] == answer
    finally:
        server.terminate()
        server.wait()
    done = subprocess.run(["bash", str(LLAMA_CPP), "llama-perplexity", "-m", str(gguf), "-f", str(text), "-c", "64",
                           "-b", "64", "-t", "1"], capture_output=True, text=True)  # -t 2 ends early at times
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    return right / len(examples), float(m.group(1)) if m else float("nan")


def quality(checkpoint: Path, work: Path, n: int) -> list[dict[str, object]]:
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from automodel_ckpt.export import consolidate, resolve_model_dir
    from automodel_ckpt.data import heldout_examples

    examples = heldout_examples(n)
    text = work / "heldout.txt"
    text.write_text(" ".join(p + a for p, a in examples) * 4)
    export = consolidate(resolve_model_dir(checkpoint), work / "bf16-export", progress=False)
    rows = []

    def add(fmt: str, runtime: str, result: tuple[float, float] | None) -> None:
        if result is not None:
            rows.append({"format": fmt, "runtime": runtime, "exact_match": result[0], "perplexity": result[1]})
            print(json.dumps(rows[-1]), flush=True)

    add("bf16 (HF export)", "transformers", transformers_quality(export, examples))
    for t in GGUF_TYPES:
        gguf = work / f"q-{t}.gguf"
        run_export(checkpoint, gguf, ["--to", "gguf", "--type", t])
        add(f"gguf {t}", "llama.cpp", llama_cpp_quality(gguf, examples, text))
        add(f"gguf {t}", "transformers (dequantized)", transformers_quality(work, examples, gguf_file=gguf.name))
    for s in INT8_SCHEMES:
        folder = work / f"q-{s}"
        run_export(checkpoint, folder, ["--to", "int8", "--scheme", s])
        add(f"int8 {s}", "transformers (dequantized)",
            transformers_quality(folder, examples, quantization_config=CompressedTensorsConfig(dequantize=True)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint of the default recipe (epoch_E_step_N)")
    parser.add_argument("--base-gb", type=float, default=1.0, help="size of the synthetic base for speed (0: none)")
    parser.add_argument("--n", type=int, default=200, help="held-out problems for exact-match")
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    parser.add_argument("--no-quality", action="store_true", help="speed and memory only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = Path(tmp)
        rows = {"quality": [] if args.no_quality else quality(args.checkpoint, work, args.n),
                "speed": speed(args.checkpoint, work, "checkpoint")}
        if args.base_gb > 0:
            base = synthetic_base(work / "base", args.base_gb)
            rows["speed"] += speed(base, work, f"{args.base_gb:g} GB base")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
