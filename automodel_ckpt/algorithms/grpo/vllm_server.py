"""The vLLM engine process of ``grpo.engine: vllm``: an HTTP server on 127.0.0.1 that loads pushed weights and samples.

Run by the vLLM environment's Python as a script; it imports only the standard library, torch, safetensors, xxhash
and vLLM (never ``automodel_ckpt``: that environment's transformers is not the product's). The trainer imports
``weights_hash`` from here, so both sides hash alike. Its endpoints: docs/rl.md, "The process".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterable

import torch
import xxhash


def weights_hash(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    """An XXH3-128 of named tensors (name, dtype, shape, bytes) in the order given, by the trainer and the engine: a
    check that both hold the same weights, read in place (a SHA-256 took 0.65 s a side for 0.66 GB, this 0.03 s)."""
    h = xxhash.xxh3_128()
    for name, tensor in items:
        t = tensor.detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def _die_with_parent() -> None:
    """Linux: SIGKILL when the process that started this one dies (no engine left behind a killed trainer)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_DEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


class Engine:
    """The vLLM ``LLM`` (in this process, dummy weights until the first ``/load``) and the weight version it holds."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        lora = {"enable_lora": True, "max_lora_rank": args.lora_rank, "max_loras": 1} if args.lora_rank else {}
        self.llm = LLM(model=args.model_dir, dtype=args.dtype, skip_tokenizer_init=True, load_format="dummy",
                       max_model_len=args.max_model_len, enforce_eager=True, enable_prefix_caching=False,
                       generation_config="vllm", seed=0, **lora)
        self.version = -1
        self.adapter: Any = None  # the LoRARequest of the last pushed adapter

    def load(self, path: str | None, adapter: str | None, version: int) -> dict[str, Any]:
        from safetensors import safe_open

        items: list[tuple[str, torch.Tensor]] = []
        weights = sorted(os.path.join(adapter, f) for f in os.listdir(adapter) if f.endswith(".safetensors")) \
            if adapter else []
        for file in [path] + weights:
            if file:
                with safe_open(file, framework="pt") as f:
                    items += [(name, f.get_tensor(name)) for name in f.keys()]
        items.sort(key=lambda item: item[0])
        digest = weights_hash(items)
        if path:
            base = [item for item in items if not item[0].startswith("base_model.model.")]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(base)})
        if adapter:
            from vllm.lora.request import LoRARequest

            self.adapter = LoRARequest(f"policy-{version}", version + 2, adapter)  # a new id: never a cached one
        self.version = version
        return {"hash": digest, "version": version}

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        eos = req.get("eos_id")
        params = [SamplingParams(temperature=req["temperature"], max_tokens=req["max_new_tokens"], seed=seed,
                                 stop_token_ids=[eos] if eos is not None else None, ignore_eos=eos is None,
                                 logprobs=0 if req.get("log_probs") else None, detokenize=False)
                  for seed in req["seeds"]]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter) if prompts else []
        answer: dict[str, Any] = {"completions": [list(o.outputs[0].token_ids) for o in outputs]}
        if req.get("log_probs"):
            answer["log_probs"] = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                   for o in outputs]
        return answer


def _handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet: one line per request is noise
            pass

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._answer(404, {"error": f"no {self.path}"})
            import vllm

            self._answer(200, {"vllm": vllm.__version__, "weight_version": engine.version})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            try:
                if self.path == "/load":
                    return self._answer(200, engine.load(req.get("path"), req.get("adapter"), int(req["version"])))
                if self.path == "/generate":
                    return self._answer(200, engine.generate(req))
                if self.path == "/stop":
                    self._answer(200, {})
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one line back to the trainer; the engine stays up
                return self._answer(500, {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            self._answer(404, {"error": f"no {self.path}"})

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="a folder with the model's config.json")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--port-file", required=True, help="where the chosen port is written once serving")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters of this rank are pushed")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    gc.set_threshold(10_000, 10, 10)  # vLLM's imports and build scanned less often by the garbage collector
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: one process to stop
    _die_with_parent()
    try:
        engine = Engine(args)
    except Exception as exc:  # no vLLM, or a family this vLLM cannot load: one line, the trainer repeats it
        try:
            from vllm import __version__ as version
        except ImportError:
            version = "(not installed)"
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"vllm_server: vLLM {version} cannot serve {args.model_dir}: {type(exc).__name__}: {detail}",
              file=sys.stderr, flush=True)
        return 2
    server = HTTPServer((args.host, args.port), _handler(engine))
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(tmp, args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
