"""The hostile-folder corpus's harness: a fork server running `ckpt-train` in limited child processes, and the checks.

Every case hands a crafted folder to a verb exactly as ``ckpt-train`` runs it (``automodel_ckpt.cli.main``), in a
process of its own, under a memory limit and a timeout. Starting a fresh interpreter per case would cost seconds of
imports, so one server process per test session imports the package, torch, transformers and safetensors once and
forks a child per case (``ForkServer.run``). The child is a real process: it sets its own resource limits, sends its
stdout and stderr to files, changes into the case's folder, runs ``main(argv)`` and ends with ``os._exit``; the
server kills its process group with SIGKILL when the timeout passes (a verb that opens a FIFO would hang forever).

What a case must leave untouched lies in an ``Outside`` folder beside it: an inotify watch records every open of a
file or folder there (a link followed out of the case's folder reads through it), and its files' bytes, types and
times are compared afterwards. ``refused`` and ``clean`` check what the user sees: one ``error: ...`` line, no
traceback, no raw control character, no sign that the memory limit was hit.

``HOSTILE_CODE_ROOT``, when set, is put first on the server's path: the corpus then runs against that checkout.
Run as a script (``python harness.py serve``) this module is the server; it imports nothing from the tests.
"""

from __future__ import annotations

import ctypes
import contextlib
import json
import os
import re
import resource
import select
import signal
import stat
import struct
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE_ROOT_ENV = "HOSTILE_CODE_ROOT"
#: Memory a case may take on top of what the server held when it forked it (address space, see ``_limit_memory``).
MEMORY_BUDGET = int(1.5 * 2**30)
#: Seconds a case may run; a verb that waits on a FIFO is killed then.
TIMEOUT_S = 60.0
#: What the server imports before it forks: every verb then starts in a few milliseconds.
PRELOAD = ("torch", "transformers", "safetensors.torch", "automodel_ckpt.cli", "automodel_ckpt.cli.train",
           "automodel_ckpt.cli.verify", "automodel_ckpt.cli.inspect", "automodel_ckpt.cli.consolidate",
           "automodel_ckpt.cli.merge_lora", "automodel_ckpt.cli.preview", "automodel_ckpt.cli.plot",
           "automodel_ckpt.cli.gc", "automodel_ckpt.export.plan", "automodel_ckpt.export.verify",
           "automodel_ckpt.export.lora_merge", "automodel_ckpt.recipes.llm_finetune",
           "transformers.models.llama.modeling_llama", "datasets", "peft", "matplotlib.pyplot")
#: Environment of every case: offline, one thread, no colour or progress bars.
CASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", "NO_COLOR": "1",
            "WANDB_MODE": "disabled", "MLFLOW_TRACKING_URI": "", "TQDM_DISABLE": "1"}


# --- the server (run as a script) ------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _limit_memory(budget: int) -> None:
    """Cap this process's address space at what it maps now plus ``budget``.

    An absolute cap cannot work: torch and transformers alone map about 2 GB of address space once imported (most
    of it never touched), so the cap is relative to the mapping the child inherits from the server. Whatever a case
    allocates beyond the budget fails (``MemoryError``, or torch's allocator error) instead of growing the machine.
    """
    limit = _status_kib("VmSize") * 1024 + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child(request: dict) -> None:
    """The forked case: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        for key, value in request["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _limit_memory(request["memory"])
        from automodel_ckpt.cli import main

        sys.argv = ["ckpt-train", *request["argv"]]
        code = main(list(request["argv"]))  # what the `ckpt-train` console script runs: sys.exit(main())
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _serve() -> None:
    import gc

    gc.set_threshold(10_000, 10, 10)  # as ``ckpt-train`` starts: the imports scanned less often
    root = os.environ.get(CODE_ROOT_ENV)
    if root:
        sys.path.insert(0, root)
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra (matplotlib, peft) missing: the verb imports it itself
            pass
    # Where DeepSpeed is installed (the DeepSpeed import tests), transformers' save_pretrained imports it (through
    # accelerate's unwrap): imported here, its memory is the idle child's too, not a case's; its one log line goes
    # to stderr, never into the reply below.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(sys.stderr):
        try:
            importlib.import_module("deepspeed")
        except ImportError:
            pass
    import automodel_ckpt

    _settle()
    reply = sys.stdout
    reply.write(json.dumps({"package": automodel_ckpt.__file__}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request)
        pidfd = os.pidfd_open(pid)
        timed_out = not select.select([pidfd], [], [], request["timeout"])[0]
        if timed_out:
            _kill_group(pid)
        _, status, usage = os.wait4(pid, 0)
        os.close(pidfd)
        _kill_group(pid)  # anything the case started and left behind
        result = {"code": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
                  "maxrss": usage.ru_maxrss * 1024, "wall": time.monotonic() - started}
        reply.write(json.dumps(result) + "\n")
        reply.flush()


def _settle() -> None:
    """What every case inherits, settled once before the first fork: torch's operator libraries' finalizers left out
    of the exit handlers a case runs, as the package's own processes leave them (``env._keep_torch_libraries``,
    where the checkout under test has it), and the preloaded objects frozen out of the garbage collector's passes
    (``gc.freeze``: a case's collections neither visit them nor copy their pages)."""
    import gc

    with contextlib.suppress(ImportError):
        from automodel_ckpt.distributed.env import _keep_torch_libraries

        _keep_torch_libraries()
    gc.collect()
    gc.freeze()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- the client --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one case did: its argv, exit code (negative: killed by that signal), output and resources."""

    argv: list[str]
    code: int
    stdout: str
    stderr: str
    timed_out: bool
    maxrss: int
    wall: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        shown = f"ckpt-train {' '.join(self.argv)}\nexit {self.code}"
        shown += " (timed out)" if self.timed_out else ""
        return f"{shown}, {self.wall:.1f} s, peak RSS {self.maxrss / 2**20:.0f} MiB\nstdout:\n{self.stdout[-3000:]}" \
               f"\nstderr:\n{self.stderr[-3000:]}"


class ForkServer:
    """One server process (the package imported once) that runs each case in a forked, limited child."""

    def __init__(self, workdir: Path, code_root: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **CASE_ENV}
        if code_root:
            env[CODE_ROOT_ENV] = code_root
        self.log = open(self.workdir / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     cwd=self.workdir)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server did not start:\n{(self.workdir / 'server.log').read_text()[-3000:]}")
        self.package = json.loads(line)["package"]
        self.count = 0
        #: The peak resident memory of a child that does nothing (``--version``): what ``lean`` measures from.
        self.rss = self.run(["--version"], cwd=self.workdir).maxrss

    def run(self, argv: list[object], *, cwd: Path, env: dict[str, str | None] | None = None,
            timeout: float = TIMEOUT_S, memory: int = MEMORY_BUDGET) -> Outcome:
        """``ckpt-train ARGV`` in ``cwd`` as a limited child process; its ``Outcome``."""
        self.count += 1
        out, err = self.workdir / f"case{self.count}.out", self.workdir / f"case{self.count}.err"
        argv = [str(a) for a in argv]
        request = {"argv": argv, "cwd": str(cwd), "env": {**CASE_ENV, **(env or {})}, "timeout": timeout,
                   "memory": memory, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died:\n{(self.workdir / 'server.log').read_text()[-3000:]}")
        result = json.loads(line)
        return Outcome(argv, result["code"], _read(out), _read(err), result["timed_out"], result["maxrss"],
                       result["wall"])

    def close(self) -> None:
        self.proc.kill()  # it holds nothing: no need to wait for torch's teardown
        self.proc.wait(timeout=30)
        self.log.close()


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "backslashreplace")


def run_script(cmd: list[object], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S,
               memory: int = MEMORY_BUDGET) -> Outcome:
    """A command that is no `ckpt-train` verb (``bash consolidate.sh``) as a subprocess under the same limits: its
    data segment is capped (an address-space cap would break torch's import in a fresh interpreter)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory + 2**30, memory + 2**30))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    argv = [str(c) for c in cmd]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **CASE_ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=limit,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        timed_out = True
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Outcome(argv, proc.returncode, out.decode("utf-8", "backslashreplace"),
                   err.decode("utf-8", "backslashreplace"), timed_out, usage.ru_maxrss * 1024,
                   time.monotonic() - started)


# --- what every case checks ---------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MEMORY_HIT = ("MemoryError", "bad_alloc", "Cannot allocate memory", "can't allocate memory", "out of memory")


def clean(outcome: Outcome) -> None:
    """What every run shows, whatever it decided: it ended in time, without a traceback or a raw control
    character in its output, and without meeting the memory limit."""
    assert not outcome.timed_out, f"hung until killed:\n{outcome}"
    assert outcome.code >= 0, f"killed by signal {-outcome.code}:\n{outcome}"
    assert "Traceback" not in outcome.output, f"a traceback:\n{outcome}"
    raw = _CONTROL.search(outcome.output)
    assert raw is None, f"a raw control character {raw.group()!r} in the output:\n{outcome}"
    hit = [m for m in _MEMORY_HIT if m in outcome.output]
    assert not hit, f"met the memory limit ({hit[0]}):\n{outcome}"


def error_lines(outcome: Outcome) -> list[str]:
    return [line for line in outcome.stderr.splitlines() if line.startswith("error: ")]


def refused(outcome: Outcome, *expected: str) -> str:
    """The verb refused: non-zero exit, exactly one ``error: ...`` line (holding every ``expected`` text). The line."""
    clean(outcome)
    lines = error_lines(outcome)
    assert outcome.code != 0, f"exit 0 where a refusal was expected:\n{outcome}"
    assert len(lines) == 1, f"{len(lines)} error lines, expected one:\n{outcome}"
    for text in expected:
        assert text in lines[0], f"{text!r} not in the error line:\n{outcome}"
    return lines[0]


def lean(outcome: Outcome, baseline: int, budget: int = 150 * 2**20) -> None:
    """The case's peak resident memory stayed within ``budget`` of an idle child's (``baseline``): a file of
    hundreds of megabytes was not read whole."""
    grown = outcome.maxrss - baseline
    assert grown <= budget, f"resident memory grew by {grown / 2**20:.0f} MiB:\n{outcome}"


def succeeded(outcome: Outcome) -> None:
    clean(outcome)
    assert outcome.code == 0 and not error_lines(outcome), f"expected success:\n{outcome}"


def refused_or_reported(outcome: Outcome, *expected: str) -> None:
    """A verb that reports damage rather than raising (``verify``): a non-zero exit with one ``error:`` line, or a
    FAILED report; either way the output names every ``expected`` text."""
    clean(outcome)
    assert outcome.code != 0, f"exit 0 for a hostile folder:\n{outcome}"
    assert len(error_lines(outcome)) <= 1, f"more than one error line:\n{outcome}"
    for text in expected:
        assert text in outcome.output, f"{text!r} not in the output:\n{outcome}"


# --- the outside of a case ----------------------------------------------------------------------------------------

_IN_ACCESS, _IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_OPEN = 0x1, 0x2, 0x4, 0x8, 0x20
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_ISDIR = 0x40, 0x80, 0x100, 0x200, 0x400, \
    0x40000000
_WATCHED = _IN_ACCESS | _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_OPEN | _IN_MOVED_FROM | _IN_MOVED_TO | \
    _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF
_EVENT_NAMES = {_IN_ACCESS: "read", _IN_MODIFY: "written", _IN_ATTRIB: "attributes changed",
                _IN_CLOSE_WRITE: "closed after writing", _IN_OPEN: "opened", _IN_MOVED_FROM: "moved away",
                _IN_MOVED_TO: "moved in", _IN_CREATE: "created", _IN_DELETE: "deleted",
                _IN_DELETE_SELF: "deleted"}


class _Inotify:
    """Linux's inotify through libc: which files and folders below a few folders were touched, and how."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.folders: dict[int, Path] = {}

    def watch(self, folder: Path) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), _WATCHED)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
        self.folders[wd] = folder

    def events(self) -> list[str]:
        out = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            i = 0
            while i < len(data):
                wd, mask, _cookie, size = struct.unpack_from("iIII", data, i)
                name = data[i + 16:i + 16 + size].rstrip(b"\0").decode("utf-8", "backslashreplace")
                i += 16 + size
                what = [text for bit, text in _EVENT_NAMES.items() if mask & bit]
                path = self.folders.get(wd, Path("?")) / name if name else self.folders.get(wd, Path("?"))
                kind = "folder" if mask & _IN_ISDIR or not name else "file"
                if what:
                    out.append(f"{kind} {path}: {', '.join(dict.fromkeys(what))}")

    def close(self) -> None:
        os.close(self.fd)


class Outside:
    """A folder beside a case that no verb may open, write, create or delete anything in.

    It holds ``secret.txt`` (a valid JSON object whose values hold ``marker``, so that a reader that follows a link
    to it parses it and shows or copies the marker), ``sentinel.bin`` (whose bytes and times are compared),
    ``pipe`` (a FIFO: a reader that opens it blocks) and ``dir/`` (a folder for links to folders, holding its own
    ``inner.json``). ``check`` fails on any inotify event under it, any change, and the marker in ``texts``.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.dir = self.root / "dir"
        self.dir.mkdir(parents=True)
        self.marker = f"OUTSIDE-MARKER-{uuid.uuid4().hex[:12]}"
        self.secret = self.root / "secret.txt"
        self.secret.write_text(json.dumps({"step": 777, "epoch": 0, "name": self.marker, "text": self.marker,
                                           "files": {}, "weight_map": {}, "model_type": self.marker}) + "\n")
        self.sentinel = self.root / "sentinel.bin"
        self.sentinel.write_bytes(self.marker.encode() * 4)
        self.pipe = self.root / "pipe"
        os.mkfifo(self.pipe)
        (self.dir / "inner.json").write_text(json.dumps({"name": self.marker}) + "\n")
        self._before = self.snapshot()
        self._watch = _Inotify()
        for folder in (self.root, self.dir):
            self._watch.watch(folder)

    def snapshot(self) -> dict[str, tuple]:
        """Every entry below the folder: its kind, size, modification time and (for a regular file) its bytes."""
        out = {}
        for path in sorted(self.root.rglob("*")):
            st = os.lstat(path)
            content = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(path.relative_to(self.root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, content)
        return out

    def check(self, *texts: str, context: str = "") -> None:
        """Nothing under the folder was touched (inotify saw nothing; the entries are as they were) and no text
        of ``texts`` (outputs, files the verb wrote) holds the marker. ``context``: shown on failure."""
        events = list(dict.fromkeys(self._watch.events()))  # first: the snapshot below opens the files itself
        assert not events, "touched outside the case's folder:\n" + "\n".join(events[:12]) + f"\n{context}"
        assert self.snapshot() == self._before, f"the folder outside the case changed\n{context}"
        self._watch.events()
        for text in texts:
            assert self.marker not in text, f"the content of a file outside the case was read:\n{context}"

    def close(self) -> None:
        self._watch.close()


def marker_in_tree(root: Path, marker: str, since_ns: int = 0) -> list[str]:
    """Regular files below ``root`` (links not followed) modified at or after ``since_ns`` whose bytes hold
    ``marker``."""
    hits = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mtime_ns >= since_ns and st.st_size < 2**27 \
                    and marker.encode() in path.read_bytes():
                hits.append(str(path))
    return hits


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
