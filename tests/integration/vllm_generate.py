"""Greedy generation with vLLM from an exported folder (run by test_vllm_interop.py in vLLM's own interpreter).

Usage: python vllm_generate.py MODEL_DIR PROMPT_IDS_JSON MAX_TOKENS  -> prints the generated token ids as JSON.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=64, enforce_eager=True, seed=0)
    # min_tokens holds EOS back, as transformers' min_new_tokens does: both generate exactly max_tokens tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    print("VLLM_OUTPUT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
