"""Runs `ckpt-train` as a user would (a subprocess, 1 or 2 processes) and reads what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_sft.yaml"
CKPT_TRAIN = str(Path(sys.executable).parent / "ckpt-train")
QUIET = ["--training.progress_bar", "false"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for(assets: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"AUTOMODEL_CKPT_ASSETS": str(assets), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def ckpt_train(cwd: Path, assets: Path, *args: str, nproc: int = 1, launcher: tuple[str, ...] = (),
               recipe: Path | str = RECIPE, env: dict[str, str] | None = None, timeout: int = 600,
               check: bool = True) -> Result:
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(nproc), *launcher, str(recipe), *QUIET, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env_for(assets, env), capture_output=True, text=True, timeout=timeout)
    result = Result(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckpt-train failed ({proc.returncode}): {' '.join(cmd)}\n{result.output[-4000:]}")
    return result


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in jsonl(Path(run_dir) / "training.jsonl")]


def tree(root: Path) -> set[str]:
    """Every file and symlink below ``root``, relative, excluding hidden helper folders' contents."""
    out = set()
    for p in Path(root).rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink() or p.is_file():
            out.add(rel)
    return out
