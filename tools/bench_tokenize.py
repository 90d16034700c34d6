"""Tokenizing chat data: the per-example loop vs ``datasets.map`` (first run, then the cached rerun).

    python tools/bench_tokenize.py [--examples 200000] [--num-proc 2] [--seq-length 512] [--out DIR]

Generates ``--examples`` chats (a system line and one to three user/assistant exchanges of generated words) as a
jsonl file, and a byte-level BPE tokenizer trained on the same words with a ChatML (Qwen2.5-style) chat template.
Then, each in a fresh process so that its peak memory is its own:

* ``loop``: how tokenization worked before: every record read from the dataset one at a time, rendered and
  tokenized on its own with ``tokenizer(...)``, the results kept in Python lists and copied into tensors at the
  end.
* ``first``: ``encode_dataset`` + ``build_rows`` (batched ``datasets.map``, ``--num-proc`` processes) into an
  empty cache folder.
* ``cached``: the same again; it finds the cache and only maps the Arrow files.

Each measures wall time and peak resident memory (the process and its tokenization workers), and checks that all
three produce the same rows. Prints a Markdown table (docs/data.md has the one measured on the machine it names)
and writes ``DIR/bench_tokenize.json``. Not a test: it takes minutes.

Times internals: imports ``data.encode`` and ``data.tokenize`` (the row builder it times) directly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the a of to and in is was for on with as by at from that it an be this are which or were has had river "
         "city king war music team game water light house story school bridge forest garden morning number answer "
         "question people world small large early later north south winter summer").split()

CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def generate(folder: Path, n: int) -> tuple[Path, Path]:
    """``chats.jsonl`` with ``n`` conversations and a tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    data = folder / "chats.jsonl"
    with data.open("w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": _sentence(rng, 3, 8)}]
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": _sentence(rng, 5, 30)},
                             {"role": "assistant", "content": _sentence(rng, 10, 60)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((_sentence(rng, 5, 30) for _ in range(5000)), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(folder / "tokenizer")
    return data, folder / "tokenizer"


def _peak_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024  # Linux reports KiB


def worker(mode: str, data: str, tokenizer_dir: str, cache: str, seq_length: int, num_proc: int) -> dict:
    import datasets
    import torch
    from transformers import AutoTokenizer

    from automodel_ckpt.data.encode import DataSpec, Encoder
    from automodel_ckpt.data.tokenize import build_rows, encode_dataset

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
    spec = DataSpec(seq_length=seq_length, num_proc=num_proc, cache_dir=str(Path(cache) / "tokenized"))
    t0 = time.perf_counter()
    if mode == "loop":
        # The previous tokenize_dataset's shape: one record at a time through ``tokenizer(...)``, Python lists,
        # tensors at the end; chats rendered (and their loss spans found) as the batched path does.
        renderer = Encoder(tok, spec, "chat").chat
        ids_rows, label_rows = [], []
        for i, example in enumerate(ds):
            text, spans = renderer.render(example["messages"], i)
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = enc["input_ids"]
            lab = [t if any(s <= o[0] < e for s, e in spans) else -100 for t, o in zip(ids, enc["offset_mapping"])]
            ids_rows.append(ids[:seq_length])
            label_rows.append(lab[:seq_length])
        input_ids = torch.full((len(ids_rows), seq_length), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(ids_rows), seq_length), -100, dtype=torch.long)
        for r, (ids, lab) in enumerate(zip(ids_rows, label_rows)):
            input_ids[r, :len(ids)] = torch.tensor(ids)
            labels[r, :len(lab)] = torch.tensor(lab)
    else:
        encoded, _ = encode_dataset(ds, tok, spec)
        rows = build_rows(encoded, spec, tok.pad_token_id)
        totals = rows.totals()
        sample = rows.batch(list(range(0, len(rows), max(len(rows) // 64, 1))))
        input_ids, labels = sample["input_ids"], sample["labels"]
    seconds = time.perf_counter() - t0
    if mode != "loop":
        tokens = totals["tokens"]
    else:
        tokens = int((input_ids != tok.pad_token_id).sum())
        step = max(len(input_ids) // 64, 1)
        input_ids, labels = input_ids[::step], labels[::step]
    digest = str(hash((input_ids.numpy().tobytes(), labels.numpy().tobytes())))
    return {"mode": mode, "seconds": seconds, "examples": len(ds), "examples_per_s": len(ds) / seconds,
            "tokens": tokens, "peak_mb": _peak_mb(), "digest": digest}


def run(mode: str, args: argparse.Namespace, data: Path, tok: Path, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, str(data), str(tok), str(cache), str(args.seq_length),
           str(args.num_proc)]
    env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, data, tok, cache, seq, procs = sys.argv[2:8]
        print(json.dumps(worker(mode, data, tok, cache, int(seq), int(procs))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="folder for data, caches and bench_tokenize.json")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_tokenize-"))
    root.mkdir(parents=True, exist_ok=True)
    data, tok = generate(root, args.examples)
    cache = root / "cache"
    results = {m: run(m, args, data, tok, cache) for m in ("first", "cached", "loop")}
    same = len({r["digest"] for r in results.values()}) == 1
    first, cached, loop = results["first"], results["cached"], results["loop"]
    print(f"{args.examples} chats, {first['tokens']} tokens, seq_length {args.seq_length}, num_proc {args.num_proc}; "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| run | seconds | examples/s | peak memory (MB) |")
    print("|---|---:|---:|---:|")
    for name, r in (("per-example loop", loop), ("datasets.map, first run", first), ("datasets.map, cached", cached)):
        print(f"| {name} | {r['seconds']:.1f} | {r['examples_per_s']:.0f} | {r['peak_mb']:.0f} |")
    print(f"first run vs loop: {loop['seconds'] / first['seconds']:.1f}x faster; cached rerun: "
          f"{100 * cached['seconds'] / first['seconds']:.2f}% of the first run; same rows: {same}")
    (root / "bench_tokenize.json").write_text(json.dumps({"args": vars(args) | {"out": str(root)}, **results,
                                                          "same_rows": same}, indent=2))


if __name__ == "__main__":
    main()
