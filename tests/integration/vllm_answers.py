"""Greedy answers with vLLM from a model folder (run by test_vllm_int8.py in vLLM's own interpreter).

Usage: python vllm_answers.py MODEL_DIR PROMPTS_JSON MAX_TOKENS  -> prints the answers (cut at end of sequence) as JSON.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=model_dir, max_model_len=64, enforce_eager=True, seed=0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    print("VLLM_OUTPUT " + json.dumps([o.outputs[0].text for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
