"""``ckpt-train env``: what a bug report needs: versions, devices, paths, the launcher's environment."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.redact import REDACTED, is_secret_key, redact_text

PACKAGES = ("automodel-ckpt", "torch", "transformers", "peft", "vllm", "lm-eval")
# the environment variables the launcher, torch's agent, the trackers and the object stores read (by prefix)
ENV_PREFIXES = ("AUTOMODEL_CKPT_", "MASTER_", "TORCHELASTIC_", "TORCH_", "PYTORCH_", "NCCL_", "CUDA_", "HF_",
                "TRANSFORMERS_", "WANDB_", "MLFLOW_", "AWS_", "S3_", "SLURM_", "OMP_", "GLOO_")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def build_parser() -> VerbParser:
    return VerbParser("env", "Versions, devices, paths and the launcher's environment (secrets redacted), for a bug "
                             "report.")


def main(argv: list[str]) -> int:
    build_parser().parse_args(argv)
    print("\n".join(lines()), flush=True)
    return 0


def lines() -> list[str]:
    out = [f"- {name}: {_version(name)}" for name in PACKAGES]
    out += [f"- devices: {_devices()}", f"- Hugging Face cache: {_hub_cache()}",
            f"- assets: {Path(os.environ.get('AUTOMODEL_CKPT_ASSETS', 'assets')).resolve()}",
            "- environment:"]
    names = sorted(n for n in os.environ if n.startswith(ENV_PREFIXES) or n in ENV_NAMES)
    out += [f"    {n}={REDACTED if is_secret_key(n) else redact_text(os.environ[n])}" for n in names] or ["    (none)"]
    return out


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    cpu = f"cpu ({os.cpu_count()} cores)"
    if not torch.cuda.is_available():
        return cpu
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(gpus)} CUDA ({', '.join(gpus)}; CUDA {torch.version.cuda}), {cpu}"


def _hub_cache() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:
        return "huggingface_hub not installed"
    return str(constants.HF_HUB_CACHE)
