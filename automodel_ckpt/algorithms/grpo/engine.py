"""GRPO's vLLM engine (``grpo.engine: vllm``): its process started and stopped, weights pushed and checked, sampling."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from automodel_ckpt.algorithms.grpo import vllm_server
from automodel_ckpt.distributed.env import broadcast_object
from automodel_ckpt.distributed.tensor_parallel import causal_lm
from automodel_ckpt.errors import ConfigError, TrainingError
from automodel_ckpt.ondisk import HFFolder

SERVER = Path(vllm_server.__file__)
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
ADAPTER_PREFIX = "base_model.model."  # a saved PEFT adapter's names
#: the launcher's variables, which would make the engine's own torch.distributed join the trainer's job
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "PYTHONPATH")


def engine_name(name: str) -> str:
    """A parameter's name as the engine takes it: the base's checkpoint name, or a saved PEFT adapter's."""
    if ".lora_" in name:
        module, _, rest = name.partition(".lora_")
        kind, _adapter, leaf = rest.split(".", 2)
        return f"{ADAPTER_PREFIX}{module}.lora_{kind}.{leaf}"
    return name.replace(".base_layer.", ".")


def engine_python(setting: str | None) -> Path:
    """``grpo.vllm.python`` as given, else ``.venv-vllm/bin/python`` in the working directory or this checkout."""
    if setting:
        found = Path(setting).expanduser()
        if not found.is_file():
            raise ConfigError(f"grpo.vllm.python: {setting} is not a file (the vLLM environment's Python)")
        return found
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / DEFAULT_PYTHON).is_file():
            return root / DEFAULT_PYTHON
    raise ConfigError(f"grpo.engine vllm: no {DEFAULT_PYTHON} here or in {Path(__file__).resolve().parents[3]}: "
                      "build it with `bash tools/setup.sh --with-vllm`, or set grpo.vllm.python or grpo.vllm.url")


class EngineLost(TrainingError):
    """The engine died, or did not answer within ``grpo.vllm.timeout``: an engine the run started is restarted once."""


@dataclass
class Sync:
    """One weight push: the trainer's hash of what it sent, the engine's of what it loaded, the bytes, seconds."""

    weight_hash: str
    engine_weight_hash: str
    sync_bytes: int
    sync_seconds: float


class VLLMEngine:
    """The engine from every rank: rank 0 talks to it over HTTP, every rank takes part in the collectives."""

    def __init__(self, settings: Any, is_main: bool) -> None:
        self.settings, self.is_main = settings, is_main
        self.url: str | None = settings.url.rstrip("/") if settings.url else None
        self.proc: subprocess.Popen | None = None
        self.folder: Path | None = None
        self.restartable = not settings.url  # an engine named by URL is someone else's
        self._started_with: tuple[Any, int] | None = None
        self.sent: set[str] = set()  # parameters the engine holds from an earlier push (a frozen one is not resent)
        self.version, self.hash, self.engine_hash = -1, "", ""  # the weights it holds: version, hash, its own hash
        self._adapter: Path | None = None  # the folder of the LoRA adapter the engine samples with

    # ------------------------------------------------------------------------------------------ process
    def start(self, model: Any, max_model_len: int) -> None:
        """Rank 0: the engine process, built from the model's config with placeholder weights."""
        self._started_with = (model, max_model_len)
        if not self.is_main or not self.restartable:
            return
        python = engine_python(self.settings.python)
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _remove_orphans(Path(base or tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix="vllm-engine-", dir=base))
        (self.folder / "trainer.pid").write_text(str(os.getpid()))
        lm = causal_lm(model)
        lm.config.save_pretrained(str(self.folder))  # config.json: what the engine builds
        dtype = str(next(lm.parameters()).dtype).removeprefix("torch.")
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC")}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer's ranks share these cores
        lora = getattr(model, "peft_config", {}).get("default")
        cmd = [str(python), str(SERVER), "--model-dir", str(self.folder), "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--port-file", str(self.folder / "port"),
               "--lora-rank", str(lora.r if lora is not None else 0)]
        with open(self.folder / "engine.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        atexit.unregister(self.close)
        atexit.register(self.close)

    def restart(self) -> None:
        """Every rank: the engine stopped and started again; the next push sends every parameter."""
        if self.is_main:
            self.close()
            self.url = None
        self.start(*self._started_with)
        self.ready()
        self.sent, self.version, self.hash, self.engine_hash = set(), -1, "", ""

    def ready(self) -> None:
        """Every rank: rank 0 waits for the engine; one that ended or never answered is one line on every rank."""
        error = self._wait() if self.is_main else None
        error = broadcast_object(error)
        if error:
            self.close()
            raise ConfigError(error)

    def _wait(self) -> str | None:
        deadline = time.monotonic() + self.settings.timeout
        while self.proc is not None and not (self.folder / "port").exists():
            if self.proc.poll() is not None:
                return f"grpo.engine vllm: the engine exited ({self.proc.returncode}): {self._last_log_line()}"
            if time.monotonic() > deadline:
                return (f"grpo.engine vllm: the engine did not start within grpo.vllm.timeout "
                        f"({self.settings.timeout:g} s; log: {self.folder / 'engine.log'})")
            time.sleep(0.1)
        if self.proc is not None:
            self.url = f"http://127.0.0.1:{(self.folder / 'port').read_text().strip()}"
        try:
            self._call("GET", "/health")
        except TrainingError as exc:
            return f"grpo.engine vllm: {exc}"
        return None

    def _last_log_line(self) -> str:
        lines = [ln for ln in (self.folder / "engine.log").read_text(errors="replace").splitlines() if ln.strip()]
        named = [ln for ln in lines if ln.startswith("vllm_server:")]
        return (named or lines or ["no output"])[-1].removeprefix("vllm_server: ")

    def close(self) -> None:
        """Rank 0: the engine it started stopped (asked, then killed) and its folder removed."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                self._call("POST", "/stop", {}, timeout=5)
                proc.wait(timeout=10)
            except (TrainingError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if self.folder is not None and proc is not None and proc.returncode in (0, -9):
            shutil.rmtree(self.folder, ignore_errors=True)

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.settings.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
            raise TrainingError(f"the vLLM engine at {self.url} answered {path} with {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineLost(f"the vLLM engine at {self.url} did not answer {path}: {exc}") from None

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def push(self, model: Any, version: int) -> Sync:
        """Every rank: the weights the engine lacks (every parameter the first time, then those that train), gathered
        one at a time, sent as ``version``; the engine's hash of what it loaded must equal the trainer's."""
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for name, param in sorted(causal_lm(model).named_parameters(), key=lambda item: item[0]):
            name = engine_name(name.replace("_orig_mod.", ""))
            if name in self.sent and not param.requires_grad:
                continue
            whole = param.full_tensor() if hasattr(param, "full_tensor") else param
            if self.is_main:
                tensors[name] = whole.detach().cpu().contiguous()
        answer: Any = None
        if self.is_main:
            answer = self._send(tensors, version, getattr(model, "peft_config", {}).get("default"))
        answer = _answer(broadcast_object(answer))
        self.sent |= set(answer["names"])
        self.version, self.hash, self.engine_hash = version, answer["weight_hash"], answer["engine_weight_hash"]
        return Sync(answer["weight_hash"], answer["engine_weight_hash"], answer["bytes"], time.perf_counter() - t0)

    def _send(self, tensors: dict[str, torch.Tensor], version: int, lora: Any) -> dict:
        """Rank 0: the base's tensors in one file, a LoRA adapter's in a folder; the hashes compared."""
        from safetensors.torch import save_file

        folder = self.folder or Path(tempfile.gettempdir())
        path = folder / f"weights-{os.getpid()}-{version}.safetensors"
        adapter = folder / f"adapter-{os.getpid()}-{version}"
        base = {k: v for k, v in tensors.items() if not k.startswith(ADAPTER_PREFIX)}
        mine = vllm_server.weights_hash(sorted(tensors.items()))
        try:
            if base:
                save_file(base, str(path))
            if lora is not None:
                lora.save_pretrained(str(adapter))  # adapter_config.json
                save_file({k: v for k, v in tensors.items() if k.startswith(ADAPTER_PREFIX)},
                          str(HFFolder(adapter).adapter_weights))
            got = self._call("POST", "/load", {"path": str(path) if base else None,
                                               "adapter": str(adapter) if lora is not None else None,
                                               "version": version})
        except TrainingError as exc:
            return _failed(exc)
        finally:
            path.unlink(missing_ok=True)
        if self._adapter is not None:
            shutil.rmtree(self._adapter, ignore_errors=True)
        self._adapter = adapter if lora is not None else None
        if got.get("hash") != mine or got.get("version") != version:
            return _failed(TrainingError(
                f"grpo.engine vllm: the engine's weights are not the trainer's after the push of weight version "
                f"{version} (engine hash {got.get('hash')}, version {got.get('version')}; trainer's {mine})"))
        return {"weight_hash": mine, "engine_weight_hash": got["hash"], "names": sorted(tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], **sampling: Any) -> dict[str, Any]:
        """Every rank: the engine's completions of ``prompts``, one per seed, asked by rank 0 and broadcast."""
        return self.collect(self.request(prompts, seeds, **sampling) if self.is_main else None)

    def request(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, max_new_tokens: int,
                temperature: float, eos_id: int | None, log_probs: bool = False) -> dict[str, Any]:
        """Rank 0 (any thread): the engine's ``completions`` (with ``log_probs``: as sampled), or its error."""
        try:
            return self._call("POST", "/generate", {
                "prompts": [list(p) for p in prompts], "seeds": [int(s) for s in seeds], "temperature": temperature,
                "max_new_tokens": max_new_tokens, "eos_id": eos_id, "log_probs": log_probs})
        except TrainingError as exc:
            return _failed(exc)

    def collect(self, answer: dict[str, Any] | None) -> dict[str, Any]:
        """Every rank: rank 0's answer (``request``), or its error raised."""
        return _answer(broadcast_object(answer))


def _remove_orphans(base: Path) -> None:
    """Remove the engine folders of trainers that are gone (killed: in /dev/shm their files hold memory)."""
    for folder in base.glob("vllm-engine-*"):
        try:
            os.kill(int((folder / "trainer.pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):  # another user's, or being made
            pass


def _failed(exc: TrainingError) -> dict[str, Any]:
    """Rank 0's error, as every rank raises it (``_answer``)."""
    return {"error": str(exc), "lost": isinstance(exc, EngineLost)}


def _answer(answer: Any) -> Any:
    if isinstance(answer, dict) and "error" in answer:
        raise (EngineLost if answer["lost"] else TrainingError)(answer["error"])
    return answer
