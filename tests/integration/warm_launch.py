"""Runs `ckpt-train` commands in processes forked from a server that has already imported what a launch imports.

A launch of ``ckpt-train`` spends most of its CPU importing torch, DCP, transformers and datasets (seconds each
time, on 2 cores the suite's largest cost). The server (one per pytest worker, started on first use) imports
what ``ckpt-train``'s launcher imports before it forks its workers (``launch.preload``) and then, for each
command, forks a child that becomes what a fresh ``ckpt-train`` process would be: the command's working folder,
environment, arguments, standard streams (the caller's own file descriptors, passed over a Unix socket), session
and default signal handlers, then the console script's ``cli.main()``. Only the imports are shared; every command
still runs its whole launcher, agent and workers, in processes of its own. ``WarmProcess`` is the caller's
``subprocess.Popen`` for such a command (pid, poll, wait, communicate, signals). (``tests/hostile/harness.py`` forks
verbs from a server too, one case at a time under a memory limit, and reports each one's peak memory.)

A command whose environment differs from the server's in a variable read at import time (``PYTHON*`` other than
``PYTHONPATH``, ``HF_*``, ``TORCH*``, ``OMP_*``, ``XDG_*``, allocator settings, ...) runs as a new interpreter, as
does every command when ``CKPT_TEST_FRESH_PROCESSES=1``; ``XDG_CACHE_HOME`` alone, where ``HF_HOME`` is set alike
(``harness.env_for`` sets it), runs forked.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

FRESH_ENV = "CKPT_TEST_FRESH_PROCESSES"
#: A file to which each command that runs as a new interpreter appends a line: its first arguments and the variables.
FRESH_LOG = "CKPT_TEST_FRESH_LOG"
#: Variables read when the server imports torch, transformers, datasets or Python itself: a command that sets them
#: otherwise than the server runs as a new interpreter.
IMPORT_TIME = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_", "MKL_",
               "KMP_", "LD_", "MALLOC_", "GLIBC_", "THP_", "TOKENIZERS", "AUTOMODEL_CKPT_MALLOC", "XDG_", "HOME",
               "TMPDIR", "CUDA", "NCCL", "TRITON", "GLOO")
#: Read at import time, but applied again by the forked child (``_apply_after_fork``): such a command still runs forked.
AFTER_FORK = ("TORCHINDUCTOR_COMPILE_THREADS",)
_MESSAGE = 1 << 20


def _import_time(name: str, env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether ``name`` is read at import time. ``XDG_CACHE_HOME`` is read then only for the default of ``HF_HOME``
    (huggingface_hub, datasets, transformers, accelerate): where both set ``HF_HOME`` alike, only the package's own
    caches (object-store mirrors) read it, when they are used."""
    if name == "XDG_CACHE_HOME" and env.get("HF_HOME") and env.get("HF_HOME") == base.get("HF_HOME"):
        return False
    return name != "PYTHONPATH" and name not in AFTER_FORK and name.startswith(IMPORT_TIME)


def _apply_after_fork() -> None:
    """In the forked child, its environment in place: what the server's imports read from the environment and the
    child sets again (``AFTER_FORK``). torch._inductor's ``compile_threads`` (the server imported its config with the
    server's environment): ``TORCHINDUCTOR_COMPILE_THREADS=1`` compiles in the process, without a pool of workers."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = config.decide_compile_threads()


def _stream_fd(stream, default: int) -> tuple[int, int | None, bool]:
    """For a ``subprocess`` stream argument: the descriptor the child writes to, the caller's read end of a pipe,
    and whether the descriptor is this module's to close once sent."""
    if stream is None:
        return default, None, False
    if stream == subprocess.PIPE:
        read, write = os.pipe()
        return write, read, True
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY), None, True
    return (stream if isinstance(stream, int) else stream.fileno()), None, False


class WarmProcess:
    """A command forked by the server, as ``subprocess.Popen`` shows one: its status comes from the server."""

    def __init__(self, launcher: WarmLauncher, args: list[str], ident: int, pid: int, stdout, stderr) -> None:
        self.launcher, self.args, self.ident, self.pid = launcher, args, ident, pid
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.launcher._status(self.ident, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self.launcher._status(self.ident, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        results: dict[str, object] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


class WarmLauncher:
    """The client: ``popen`` and ``run`` as ``subprocess``'s, for a command ``accepts`` lets it fork."""

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = dict(base_env)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._send = threading.Lock()
        self._replies = threading.Condition()
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._next = 0

    def accepts(self, cmd: list[str], env: dict[str, str]) -> bool:
        if os.environ.get(FRESH_ENV) == "1" or not cmd or Path(cmd[0]).name != "ckpt-train":
            return False
        names = set(env) | set(self.base_env)
        differ = sorted(n for n in names if _import_time(n, env, self.base_env) and env.get(n) != self.base_env.get(n))
        if differ and os.environ.get(FRESH_LOG):  # which commands ran as new interpreters, and why
            with open(os.environ[FRESH_LOG], "a") as log:
                log.write(json.dumps({"command": cmd[1:4], "variables": differ}) + "\n")
        return not differ

    def _server(self) -> socket.socket:
        if self._proc is None or self._proc.poll() is not None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=self.base_env,
                                          pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            self._sock = ours
            threading.Thread(target=self._read_replies, args=(ours,), daemon=True).start()
        return self._sock

    def _read_replies(self, sock: socket.socket) -> None:
        while True:
            message = sock.recv(_MESSAGE)
            with self._replies:
                if not message:  # the server ended (its traceback is on stderr): its commands count as killed
                    self._codes.update({i: -signal.SIGKILL for i in range(1, self._next + 1) if i not in self._codes})
                    self._replies.notify_all()
                    return
                reply = json.loads(message)
                if "pid" in reply:
                    self._pids[reply["id"]] = reply["pid"]
                else:
                    self._codes[reply["id"]] = reply["returncode"]
                self._replies.notify_all()

    def _status(self, ident: int, timeout: float | None) -> int | None:
        with self._replies:
            self._replies.wait_for(lambda: ident in self._codes, timeout)
            return self._codes.get(ident)

    def popen(self, cmd: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None,
              stdout=None, stderr=None, text: bool = False, start_new_session: bool = False) -> WarmProcess:
        env = dict(os.environ) if env is None else env
        out, out_read, out_owned = _stream_fd(stdout, 1)
        err, err_read, err_owned = (out, None, False) if stderr == subprocess.STDOUT else _stream_fd(stderr, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        with self._send:
            sock = self._server()
            self._next += 1
            ident = self._next
            request = {"id": ident, "argv": [str(c) for c in cmd], "cwd": str(cwd or os.getcwd()), "env": env,
                       "new_session": start_new_session}
            socket.send_fds(sock, [json.dumps(request).encode()], [null, out, err])
        for fd, owned in ((null, True), (out, out_owned), (err, err_owned)):
            if owned:
                os.close(fd)
        with self._replies:
            self._replies.wait_for(lambda: ident in self._pids or ident in self._codes)
            pid = self._pids.get(ident, -1)
        mode = "r" if text else "rb"
        return WarmProcess(self, list(cmd), ident, pid, None if out_read is None else open(out_read, mode),
                           None if err_read is None else open(err_read, mode))

    def run(self, cmd: list[str], cwd: Path | str | None, env: dict[str, str],
            timeout: float | None) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``."""
        with tempfile.TemporaryDirectory(prefix="warm-launch-") as tmp:
            paths = Path(tmp) / "stdout", Path(tmp) / "stderr"
            with open(paths[0], "w") as out, open(paths[1], "w") as err:
                proc = self.popen(cmd, cwd, env, stdout=out, stderr=err)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                from tests.integration.harness import JobTimeout, dump_stacks, kill_job

                dump_stacks(proc)  # where each process stood, in the job's stderr
                kill_job(proc)
                raise JobTimeout(cmd, timeout, *(p.read_text(errors="replace") for p in paths))
            return subprocess.CompletedProcess(cmd, code, *(p.read_text(errors="replace") for p in paths))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._sock.shutdown(socket.SHUT_RDWR)
            self._proc.wait(timeout=60)


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into the requested ``ckpt-train`` process and run it; never returns."""
    import random

    code = 1
    try:
        if request["new_session"]:
            os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE,
                    signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _apply_after_fork()
        os.closerange(3, 1 << 16)  # the server's socket and pipes (the server waits for this): a new process has none
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


def serve(sock: socket.socket) -> None:
    """The server: import what a launch imports, then fork one child per request and report its pid and status."""
    # no huge pages for tensors: ``ckpt-train`` turns them on only for a recipe that shards for sure
    # (``cli.train.huge_pages_if_sharded``), and most tests replicate; a sharded test only steps slower here
    faulthandler.enable()  # every process forked from here prints its threads' stacks on SIGABRT (``dump_stacks``)
    gc.set_threshold(10_000, 10, 10)  # as ``ckpt-train`` starts: the imports scanned less often
    import automodel_ckpt.checkpoint  # noqa: F401
    import automodel_ckpt.cli.common  # noqa: F401
    import automodel_ckpt.cli.train  # noqa: F401
    import automodel_ckpt.config.loader  # noqa: F401
    from automodel_ckpt.launch import preload

    # and the tiny recipes' family, which each launcher would import before forking (``cli.train.family_module``)
    preload("automodel_ckpt.recipes.llm_finetune.FinetuneRecipeForNextTokenPrediction",
            ("transformers.models.llama.modeling_llama",))
    gc.collect()
    gc.freeze()  # what every command inherits, out of its garbage collector's passes (neither visited nor copied)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the loop below
    running: dict[int, int] = {}  # pid -> request id
    while True:
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ident = running.pop(pid, None)
            if ident is not None:
                sock.send(json.dumps({"id": ident, "returncode": os.waitstatus_to_exitcode(status)}).encode())
        if sock in ready:
            message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
            if not message:
                return
            request = json.loads(message)
            started, set_up = os.pipe()
            pid = os.fork()
            if pid == 0:
                _become(request, fds)
            for fd in (*fds, set_up):
                os.close(fd)
            os.read(started, 1)  # its end of the pipe closed: in its session, streams and folder (as Popen returns)
            os.close(started)
            running[pid] = request["id"]
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


if __name__ == "__main__":
    sys.path[0] = str(Path(sys.executable).parent)  # as for the console script, not this file's folder
    serve(socket.socket(fileno=int(sys.argv[1])))
