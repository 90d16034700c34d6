"""Does the tiny DPO recipe learn? DPO (from the embedded base, or from an SFT export), then greedy answers on
held-out problems.

    python tools/dpo_learns.py [--sft-steps 0] [--dpo-steps N] [--rpo-alpha A] [--lr LR] [--nproc 1]
        [--work DIR] [--json FILE] [-- MORE DPO OVERRIDES]

1. with ``--sft-steps`` > 0: ``recipes/tiny_llama_sft.yaml`` for that many steps (its consolidated export is the
   DPO start); with 0 (the default) the DPO recipe starts from its own start, the embedded base;
2. ``recipes/tiny_llama_dpo.yaml`` (from that export when there is one: ``model.pretrained_model_name_or_path``,
   the policy and its frozen reference both start there), with the recipe's own steps, learning rate and
   ``dpo.rpo_alpha`` unless ``--dpo-steps``, ``--lr``, ``--rpo-alpha`` (0: none, plain DPO) or further overrides
   after ``--`` say otherwise, validated on held-out problems only (the recipe's ``validation_dataset``: a split
   disjoint from training by construction);
3. greedy answers of the start (the SFT export or the embedded base) and of the DPO export on 400 held-out
   problems (``heldout_examples``): how often each gives the chosen answer (the right sum) and how often a near
   miss.

Prints and writes (``--json``) the held-out reward accuracy at each validation, and both models' greedy
accuracy. The issue's bar: held-out reward accuracy >= 0.9 and DPO's greedy accuracy above the start's.
Minutes on CPU; a slow check, not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(work: Path, recipe: str, nproc: int, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(nproc), str(REPO / "recipes" / recipe),
           "--training.progress_bar", "false", *overrides]
    env = dict(os.environ, AUTOMODEL_CKPT_ASSETS=str(work / "assets"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / f"{recipe}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def greedy_accuracy(model_dir: Path, n: int = 400) -> dict[str, float]:
    """Shares of held-out prompts whose greedy answer is the right sum, and a near miss (off by 1 or 10)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from automodel_ckpt.data import heldout_examples

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    examples = heldout_examples(n)
    batch = tokenizer([p for p, _ in examples], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    right = near = 0
    for (_, want), got in zip(examples, answers):
        got = got.strip()
        right += got == want
        near += got.isdigit() and abs(int(got) - int(want)) in (1, 10)
    return {"chosen": right / len(examples), "near_miss": near / len(examples)}


def newest_export(run: Path) -> Path:
    """The consolidated export of the run's last checkpoint."""
    last = max(run.glob("epoch_*_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return last / "model" / "consolidated"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=0, help="0: DPO from the embedded base, as the recipe ships")
    p.add_argument("--dpo-steps", type=int, help="default: the recipe's max_steps")
    p.add_argument("--rpo-alpha", type=float, help="default: the recipe's; 0: plain DPO")
    p.add_argument("--lr", type=float, help="default: the recipe's")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", help="more DPO recipe overrides (after --)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dpo-learns-"))
    work.mkdir(parents=True, exist_ok=True)
    start: list[str] = []
    if args.sft_steps:
        train(work, "tiny_llama_sft.yaml", args.nproc, "--step_scheduler.max_steps", str(args.sft_steps),
              "--step_scheduler.ckpt_every_steps", str(args.sft_steps), "--checkpoint.checkpoint_dir", "sft",
              "--data.val_size", "64")
        base = newest_export(work / "sft")
        start = ["--model.pretrained_model_name_or_path", str(base), "--model.embedded", "null"]
    else:
        base = work / "assets" / "tiny_llama_base"  # the embedded base, made there by the DPO run
    overrides = [*start, "--checkpoint.checkpoint_dir", "dpo", *args.overrides]
    if args.dpo_steps:
        overrides += ["--step_scheduler.max_steps", str(args.dpo_steps)]
    if args.lr is not None:
        overrides += ["--optimizer.lr", str(args.lr)]
    if args.rpo_alpha is not None:
        overrides += ["--dpo.rpo_alpha", str(args.rpo_alpha) if args.rpo_alpha else "null"]
    train(work, "tiny_llama_dpo.yaml", args.nproc, *overrides)
    dpo = newest_export(work / "dpo")
    validation = [json.loads(line) for line in (work / "dpo" / "validation.jsonl").read_text().splitlines()]
    report = {"sft_steps": args.sft_steps, "dpo_steps": int(dpo.parents[1].name.rsplit("_", 1)[1]),
              "overrides": overrides[len(start):],
              "heldout_reward_accuracy": {r["step"]: r["val_reward_accuracy"] for r in validation},
              "greedy_start": greedy_accuracy(base), "greedy_dpo": greedy_accuracy(dpo)}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")

if __name__ == "__main__":
    main()
