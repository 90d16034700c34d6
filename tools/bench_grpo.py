"""GRPO's speed: tokens generated per second and generation's share of a step, beside TRL's GRPOTrainer.

    python tools/bench_grpo.py [--steps 12] [--warmup 2] [--num-generations 8] [--prompts 8] [--max-new-tokens 4]
        [--nproc 1] [--device cpu|cuda] [--engine transformers|vllm] [--model tiny|qwen2.5-0.5b-width]
        [--trl-python PATH] [--trl-vllm] [--work DIR] [--json FILE]

Both sides train the same model (``--model``: the embedded tiny Llama base, or a 2-layer Qwen2 of Qwen2.5-0.5B's
width and vocabulary, randomly initialised with the tiny tokenizer; float32, made in ``--work``), on the same prompts
(the built-in addition task, ``"37+45="``), with the same group size G, prompts per step, ``max_new_tokens``,
temperature 1, one pass per rollout batch (``num_iterations`` 1), no reference (``beta`` 0) and the same reward
(``exact_answer``), for ``--steps`` optimizer steps; the first ``--warmup`` are left out of the numbers.

* ours: ``recipes/tiny_llama_grpo.yaml`` through ``ckpt-train`` (``--nproc`` processes, no checkpoints), sampling
  with ``--engine`` (``grpo.engine``: ``vllm`` needs ``.venv-vllm``; its weight pushes are not counted as
  generation); per step ``training.jsonl``'s ``generation_seconds``, ``step_seconds`` and ``completion_length``;
* TRL: ``trl.GRPOTrainer`` on one process, run by ``--trl-python`` (an interpreter where ``import trl`` works, e.g.
  a separate virtual environment: TRL is not a dependency of this package); its generation
  (``_generate_single_turn``) is timed around each call and the step is the time between two step ends. With
  ``--trl-vllm`` TRL samples with vLLM in its own process (``use_vllm``, ``vllm_mode`` colocate), its weight syncs
  left out of generation as ours are; ``--trl-python`` then needs the vLLM TRL supports (TRL 1.16: 0.22 to 0.31).

``--device cuda``: both on the GPU (ours: one GPU per process, as ``ckpt-train`` picks it; TRL without ``use_cpu``);
``cpu`` (the default) hides any GPU from both.

Prints and writes (``--json``) per side: generated tokens per second of generation, generation's share of the
step, seconds per step; and ours over TRL's. A TRL that cannot run is reported with its one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
#: Qwen2.5-0.5B's width, heads and vocabulary (its config.json), with 2 of its 24 layers
QWEN_WIDTH = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}


def base_model(work: Path, model: str) -> Path | None:
    """The folder of ``--model`` (None: the recipe's embedded tiny base, made by the run in ``work/assets``)."""
    if model == "tiny":
        return None
    folder = work / "qwen2.5-0.5b-width"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from automodel_ckpt.models.tiny import build_tokenizer

        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN_WIDTH)).save_pretrained(folder)
        build_tokenizer().save_pretrained(folder)
    return folder


def ours(work: Path, args: argparse.Namespace) -> dict[str, float]:
    batch = args.num_generations * args.prompts
    cmd = [sys.executable, "-m", "automodel_ckpt", "--nproc-per-node", str(args.nproc),
           str(REPO / "recipes" / "tiny_llama_grpo.yaml"), "--training.progress_bar", "false",
           "--checkpoint.enabled", "false", "--checkpoint.checkpoint_dir", "ours",
           "--step_scheduler.max_steps", str(args.steps), "--step_scheduler.global_batch_size", str(batch),
           "--step_scheduler.local_batch_size", str(batch // args.nproc),
           "--grpo.num_generations", str(args.num_generations), "--grpo.max_new_tokens", str(args.max_new_tokens),
           "--grpo.temperature", "1.0", "--grpo.num_iterations", "1", "--grpo.beta", "0.0",
           "--grpo.reward_funcs", "[automodel_ckpt.training.rewards.exact_answer]", "--grpo.reward_weights", "[1.0]",
           "--grpo.advantage", "normalized", "--grpo.engine", args.engine]  # TRL's: (reward - mean) / std
    folder = base_model(work, args.model)
    if folder is not None:
        cmd += ["--model.pretrained_model_name_or_path", str(folder)]
    env = dict(os.environ, AUTOMODEL_CKPT_ASSETS=str(work / "assets"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc))),
               **_devices(args.device))
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / "ours.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    from automodel_ckpt.ondisk import RunFolder

    log = RunFolder(work / "ours").training_log.read_text()
    rows = [json.loads(line) for line in log.splitlines()][args.warmup:]
    tokens = sum(r["completion_length"] * batch for r in rows)
    gen = sum(r["generation_seconds"] for r in rows)
    step = sum(r["step_seconds"] for r in rows)
    return summary(tokens, gen, step, len(rows))


def _devices(device: str) -> dict[str, str]:
    """Environment that hides the GPUs from a run on ``cpu``."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def summary(tokens: float, gen: float, step: float, steps: int) -> dict[str, float]:
    return {"steps": steps, "generated_tokens": tokens, "generation_seconds": round(gen, 4),
            "step_seconds": round(step / max(steps, 1), 4), "tokens_per_second": round(tokens / max(gen, 1e-9), 1),
            "generation_share": round(gen / max(step, 1e-9), 3)}


def trl_side(work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Run in the TRL interpreter: GRPOTrainer on the same model, prompts, G and reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from omegaconf import OmegaConf

    from automodel_ckpt.config.instantiate import instantiate
    from automodel_ckpt.training.rewards import exact_answer

    torch.manual_seed(42)
    base = base_model(work, args.model) or work / "assets" / "tiny_llama_base"
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    rows = instantiate(OmegaConf.load(REPO / "recipes" / "tiny_llama_grpo.yaml").dataset, "dataset")  # its prompts
    data = rows.rename_column("completion", "answer").remove_columns(["id"])  # TRL drops a 'completion' column

    def exact(prompts, completions, answer, **_):
        return exact_answer(prompts, completions, answer)

    batch = args.num_generations * args.prompts
    config = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=batch,
                        gradient_accumulation_steps=1, num_generations=args.num_generations,
                        max_completion_length=args.max_new_tokens, temperature=1.0, num_iterations=1, beta=0.0,
                        learning_rate=1e-4, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[],
                        use_cpu=args.device == "cpu", bf16=False, seed=42, disable_tqdm=True, dataloader_num_workers=0,
                        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
                           if args.trl_vllm else {}))
    trainer = GRPOTrainer(model=model, reward_funcs=exact, args=config, train_dataset=data,
                          processing_class=tokenizer)
    timings: list[tuple[float, int]] = []  # (generation seconds, tokens) per call
    ends: list[float] = []
    generate = trainer._generate_single_turn

    synced = [0.0]  # seconds of TRL's weight syncs to its vLLM, left out of generation as ours are

    def timed(*a, **k):
        t0, before = time.perf_counter(), synced[0]
        completion_ids, logprobs = generate(*a, **k)
        timings.append((time.perf_counter() - t0 - (synced[0] - before), sum(len(c) for c in completion_ids)))
        return completion_ids, logprobs

    if args.trl_vllm:
        sync = trainer.vllm_generation.sync_weights

        def timed_sync(*a, **k):
            t0 = time.perf_counter()
            sync(*a, **k)
            synced[0] += time.perf_counter() - t0

        trainer.vllm_generation.sync_weights = timed_sync

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer._generate_single_turn = timed
    trainer.add_callback(StepEnds())
    trainer.train()
    kept = timings[args.warmup + 1:len(ends)]  # generation of step k+1 lies between step ends k and k+1
    step = ends[-1] - ends[args.warmup]
    return summary(sum(t for _, t in kept), sum(s for s, _ in kept), step, len(ends) - 1 - args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--nproc", type=int, default=1, help="processes of our run (TRL's is one)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers", help="what samples ours")
    p.add_argument("--model", choices=("tiny", "qwen2.5-0.5b-width"), default="tiny", help="what both sides train")
    p.add_argument("--trl-python", default=None, help="an interpreter with trl installed (default: skip TRL)")
    p.add_argument("--trl-vllm", action="store_true", help="TRL samples with vLLM in its process (use_vllm, "
                   "vllm_mode colocate): --trl-python needs vllm too")
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--trl-side", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup + 1")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.trl_side:
        print(json.dumps(trl_side(work, args)))
        return
    report: dict[str, object] = {"settings": {k: v for k, v in vars(args).items() if k not in ("work", "json",
                                                                                              "trl_side")}}
    report["ours"] = ours(work, args)  # also makes the embedded base in work/assets
    if args.trl_python:
        cmd = [args.trl_python, str(Path(__file__).resolve()), "--trl-side", "--work", str(work),
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("steps", "warmup", "num_generations", "prompts", "max_new_tokens", "device", "model")],
               *(["--trl-vllm"] if args.trl_vllm else [])]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", **_devices(args.device))
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        (work / "trl.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            report["trl"] = {"error": lines[-1] if lines else f"exit {done.returncode}"}
        else:
            report["trl"] = json.loads(done.stdout.strip().splitlines()[-1])
            o, t = report["ours"], report["trl"]
            report["ours_over_trl"] = {"tokens_per_second": round(o["tokens_per_second"] / t["tokens_per_second"], 2),
                                       "step_seconds": round(o["step_seconds"] / t["step_seconds"], 2)}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
