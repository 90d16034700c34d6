"""Does vLLM sample a request the same alone as in a batch? Run under the vLLM environment's Python:

    .venv-vllm/bin/python tools/vllm_batch_invariance.py MODEL_FOLDER [--requests 1024] [--max-new-tokens 4]

MODEL_FOLDER: a Hugging Face folder (config, safetensors, tokenizer.json), e.g. the embedded tiny Llama's base or an
exported checkpoint. Prompts are the built-in addition task's ("37+45=", character tokens after the beginning of
sequence), each sampled with its own seed as GRPO does. The same requests are sampled as one batch, in the reverse
order, in batches of 7, and one at a time; the JSON line printed says how many completions (token ids) and sampled
log-probs (bit for bit) differ from the whole batch's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(args.model) / "tokenizer.json").read_text())["model"]["vocab"]
    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, max_model_len=64, enforce_eager=True,
              enable_prefix_caching=False, generation_config="vllm", seed=0)
    engine_seconds = time.perf_counter() - started
    rng = random.Random(0)
    texts = [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(args.requests // 16)]
    prompts = [[vocab["<s>"]] + [vocab[c] for c in t] for t in texts for _ in range(16)][:args.requests]
    seeds = [rng.randrange(1 << 62) for _ in prompts]

    def sample(order: list[int]) -> dict[int, tuple[list[int], list[float]]]:
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=seeds[i],
                                 stop_token_ids=[vocab["</s>"]], logprobs=0, detokenize=False) for i in order]
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in order], params, use_tqdm=False)
        got = {}
        for i, o in zip(order, outs):
            c = o.outputs[0]
            got[i] = (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        return got

    everyone = list(range(len(prompts)))
    t0 = time.perf_counter()
    whole = sample(everyone)
    batch_seconds = time.perf_counter() - t0
    ways = {"reversed": sample(everyone[::-1])}
    sevens: dict[int, tuple[list[int], list[float]]] = {}
    for start in range(0, len(everyone), 7):
        sevens |= sample(everyone[start:start + 7])
    ways["batches_of_7"] = sevens
    alone: dict[int, tuple[list[int], list[float]]] = {}
    for i in everyone[:256]:  # one at a time: the first 256
        alone |= sample([i])
    ways["alone_first_256"] = alone
    report = {"model": args.model, "requests": len(prompts), "engine_start_seconds": round(engine_seconds, 2),
              "whole_batch_seconds": round(batch_seconds, 3)}
    for name, got in ways.items():
        report[name] = {"compared": len(got),
                        "completions_differ": sum(got[i][0] != whole[i][0] for i in got),
                        "log_probs_differ": sum(got[i][1] != whole[i][1] for i in got)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
