"""Runs `ckpt-train` as a user would (its own process, forked warm where it can), reads what it wrote, kills jobs."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_llama_sft.yaml"
CKPT_TRAIN = str(Path(sys.executable).parent / "ckpt-train")
QUIET = ["--training.progress_bar", "false"]
#: Variables a verb run in this process (``cli.main(argv)``: ``cli.quiet_third_party``, ``cli.train``'s huge pages) or a
#: library imported in it (Lightning, lm-eval, scikit-learn through it) sets in ``os.environ``. A command sets what
#: it needs of them itself, so they are not handed on unless pytest started with them: each is read at import time,
#: and a command given one would run as a new interpreter instead of forking warm (``warm_launch``).
SET_IN_THIS_PROCESS = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
                       "THP_MEM_ALLOC_ENABLE", "PYTORCH_NVML_BASED_CUDA_CHECK", "HF_XET_HIGH_PERFORMANCE",
                       "KMP_DUPLICATE_LIB_OK")
_STARTED_WITH = {name: os.environ[name] for name in SET_IN_THIS_PROCESS if name in os.environ}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for(assets: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a command on ``assets``, with ``extra``. ``HF_HOME`` is spelled out (the
    folder Hugging Face's libraries default to here): a command that sets its own ``XDG_CACHE_HOME`` (an
    object-store mirror of its own) keeps the Hugging Face caches every other command uses."""
    env = dict(os.environ)
    hf_home = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "huggingface")
    env.update({"AUTOMODEL_CKPT_ASSETS": str(assets), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HOME": env.get("HF_HOME", hf_home)})
    env.update(extra or {})
    return env


def default_recipe_checkpoint(given: str | None, work: Path) -> Path:
    """The checkpoint ``given`` (a path), else the newest checkpoint of the default recipe trained in ``work`` (its
    own assets folder, one thread: minutes on a CPU)."""
    if given:
        return Path(given)
    from automodel_ckpt.ondisk import catalog

    env = {**os.environ, "AUTOMODEL_CKPT_ASSETS": str(work / "assets"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "automodel_ckpt", str(RECIPE), "--checkpoint.checkpoint_dir",
                    str(work / "checkpoints")], cwd=work, env=env, check=True, capture_output=True, timeout=3600)
    return catalog.latest_checkpoint(work / "checkpoints")


def ckpt_train(cwd: Path, assets: Path, *args: str, nproc: int = 1, launcher: tuple[str, ...] = (),
               recipe: Path | str = RECIPE, env: dict[str, str] | None = None, timeout: int = 600,
               check: bool = True) -> Result:
    cmd = [CKPT_TRAIN, "--nproc-per-node", str(nproc), *launcher, str(recipe), *QUIET, *args]
    proc = run_command(cmd, cwd=cwd, env=env_for(assets, env), timeout=timeout)
    result = Result(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckpt-train failed ({proc.returncode}): {' '.join(cmd)}\n{result.output[-4000:]}")
    return result


@functools.cache
def _warm_launcher():
    """This process's warm launcher (``warm_launch``), its server started on first use."""
    from tests.integration.warm_launch import WarmLauncher

    return WarmLauncher(_handed_on(env_for(Path("/nonexistent"))))  # the assets folder is each command's own


def _warm(cmd: list[str], env: dict[str, str]):
    """The warm launcher when it takes ``cmd`` under ``env``, else None."""
    launcher = _warm_launcher()
    return launcher if launcher.accepts(cmd, env) else None


def _handed_on(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what this process set of ``SET_IN_THIS_PROCESS`` since pytest started."""
    return {k: v for k, v in env.items() if k not in SET_IN_THIS_PROCESS or _STARTED_WITH.get(k) == v}


def run_command(cmd: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``; a ``ckpt-train`` command runs forked from a server
    that has its imports done (``warm_launch``) when its environment allows."""
    env = _handed_on(dict(os.environ) if env is None else env)
    warm = _warm(cmd, env)
    if warm is not None:
        return warm.run(cmd, cwd, env, timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_command(cmd: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None, stdout=None,
                  stderr=None, text: bool = False, start_new_session: bool = False):
    """``subprocess.Popen`` with these arguments; a ``ckpt-train`` command forked warm as for ``run_command``."""
    env = _handed_on(dict(os.environ) if env is None else env)
    warm = _warm(cmd, env)
    if warm is not None:
        return warm.popen(cmd, cwd, env, stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=start_new_session)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on (for a launch's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_failure(done: subprocess.CompletedProcess) -> str:
    """What a failed ``torch.distributed.run`` launch printed: the workers' own lines first (the root cause), then
    the tail (torch's summary of which rank ended how), so that neither hides the other."""
    err = done.stderr
    head = err if len(err) <= 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"
    return f"exit {done.returncode}\nstdout (tail):\n{done.stdout[-1500:]}\nstderr:\n{head}"


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


# --- processes ---------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[ppid].append(int(entry))
    return out


def process_tree(pid: int) -> list[int]:
    children = _children()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_job(proc: subprocess.Popen) -> None:
    """SIGSTOP the launcher and every descendant (the workers run in sessions of their own): nothing of the job
    runs on until ``kill_job``."""
    _freeze(proc.pid)


def _freeze(pid: int) -> list[int]:
    """SIGSTOP ``pid`` and its descendants, again until no new one appears (one forked before its parent stopped);
    all of them, parents first."""
    stopped: list[int] = []
    while new := [p for p in process_tree(pid) if p not in stopped]:
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped += new
    return stopped


class JobTimeout(subprocess.TimeoutExpired):
    """A command past its timeout; its message ends with the tail of what it printed, the stacks that
    ``dump_stacks`` had each of its processes print included."""

    def __str__(self) -> str:
        lines = (self.stderr or "").splitlines() if isinstance(self.stderr, str) else []
        tail = "\n".join(line for line in lines if not line.startswith("Extension modules:"))[-12000:]
        return f"{super().__str__()}\n--- the end of its stderr ---\n{tail}"


def dump_stacks(proc: subprocess.Popen, wait_s: float = 5.0) -> None:
    """Where each process of a job that hangs stands, in the job's stderr: the job is stopped (``_freeze``), then
    each process, the workers first, is sent SIGABRT and let run alone until it ends (up to ``wait_s``), so that the
    others neither react to its end nor print over it. A process forked from the warm launcher's server prints its
    threads' Python stacks (``faulthandler``); a job of new interpreters just ends."""
    for pid in reversed(_freeze(proc.pid)):
        try:
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def kill_job(proc: subprocess.Popen) -> int:
    """SIGKILL the launcher's process group and every descendant; wait until all are gone. Returns #processes.

    The job is stopped first (``_freeze``): a worker forked while the launcher was being killed would otherwise
    outlive it in a session of its own, holding the run folder's lock."""
    pids = _freeze(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(pids)
