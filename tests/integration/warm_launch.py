"""Runs `ckpt-train` commands in processes forked from a server that has already imported what a launch imports.

A launch of ``ckpt-train`` spends most of its CPU importing torch, DCP, transformers and datasets (seconds each
time, on 2 cores the suite's largest cost). The server (one per pytest worker, started on first use) imports
what ``ckpt-train``'s launcher imports before it forks its workers (``launch.preload``) and then, for each
command, forks a child that becomes what a fresh ``ckpt-train`` process would be: the command's working folder,
environment, arguments, standard streams (files the caller reads) and default signal handlers, then the console
script's ``cli.main()``. Only the imports are shared; every command still runs its whole launcher, agent and
workers, in processes of its own.

A command whose environment differs from the server's in a variable read at import time (``PYTHON*`` other than
``PYTHONPATH``, ``HF_*``, ``TORCH*``, ``OMP_*``, allocator settings, ...) runs as a new interpreter, as does every
command when ``CKPT_TEST_FRESH_PROCESSES=1``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FRESH_ENV = "CKPT_TEST_FRESH_PROCESSES"
#: Variables read when the server imports torch, transformers, datasets or Python itself: a command that sets them
#: otherwise than the server runs as a new interpreter.
IMPORT_TIME = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_", "MKL_",
               "KMP_", "LD_", "MALLOC_", "GLIBC_", "THP_", "TOKENIZERS", "AUTOMODEL_CKPT_MALLOC", "XDG_", "HOME",
               "TMPDIR", "CUDA", "NCCL", "TRITON", "GLOO")


def _import_time(name: str) -> bool:
    return name != "PYTHONPATH" and name.startswith(IMPORT_TIME)


class WarmLauncher:
    """The client: ``run(cmd, cwd, env, timeout)`` returns what ``subprocess.run(..., capture_output=True,
    text=True)`` would, or None when the command must run as a new interpreter."""

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = dict(base_env)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def accepts(self, cmd: list[str], env: dict[str, str]) -> bool:
        if os.environ.get(FRESH_ENV) == "1" or not cmd or Path(cmd[0]).name != "ckpt-train":
            return False
        names = set(env) | set(self.base_env)
        return not any(_import_time(n) and env.get(n) != self.base_env.get(n) for n in names)

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, __file__], env=self.base_env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO)
        return self._proc

    def run(self, cmd: list[str], cwd: Path | str | None, env: dict[str, str],
            timeout: float | None) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory(prefix="warm-launch-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            server = self._server()
            request = {"argv": [str(c) for c in cmd], "cwd": str(cwd or os.getcwd()), "env": env,
                       "stdout": str(out), "stderr": str(err)}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            ready, _, _ = select.select([server.stdout], [], [], timeout)
            if not ready:
                from tests.integration.harness import process_tree

                for p in process_tree(pid):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            code = json.loads(server.stdout.readline())["returncode"]
            stdout = out.read_text(errors="replace")
            stderr = err.read_text(errors="replace")
            if not ready:
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


def _become(request: dict) -> None:
    """In the forked child: turn into the requested ``ckpt-train`` process and run it; never returns."""
    import random

    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in paths if p not in sys.path]
        sys.argv = list(request["argv"])
        random.seed()
        from automodel_ckpt.cli import main

        try:
            code = main()
        except SystemExit as exc:
            code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # what an interpreter prints for an uncaught exception, and its status
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def serve() -> None:
    """The server: import what a launch imports, then fork one child per request line and report its status."""
    from automodel_ckpt.distributed.allocator import huge_pages_for_tensors

    huge_pages_for_tensors()  # as ``ckpt-train`` does before its first tensor
    import automodel_ckpt.checkpoint  # noqa: F401
    import automodel_ckpt.cli.common  # noqa: F401
    import automodel_ckpt.cli.train  # noqa: F401
    import automodel_ckpt.config.loader  # noqa: F401
    from automodel_ckpt.launch import preload

    preload("automodel_ckpt.recipes.llm_finetune.FinetuneRecipeForNextTokenPrediction")
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        replies.flush()
        pid = os.fork()
        if pid == 0:
            _become(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    sys.path[0] = str(Path(sys.executable).parent)  # as for the console script, not this file's folder
    serve()
