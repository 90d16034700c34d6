"""A pytest plugin: the wall and CPU seconds of each test, and of each file, to find the tests that leave cores idle.

    .venv/bin/python -m pytest -q -n 0 -p tools.pytest_cpu tests/integration
    PYTEST_CPU_OUT=/tmp/cpu.jsonl .venv/bin/python -m pytest -q -n 0 -p tools.pytest_cpu tests/integration

Not on by default. For each test (setup, call and teardown together) it takes the CPU seconds of this process and of
every process below it: its own user and system time, what its reaped children used (``cutime``/``cstime``: the
warm launcher's server reaps the ``ckpt-train`` commands it forks, so theirs lands in its child counters), and the
user, system and child times of each descendant still alive, before and after; the difference is the test's CPU,
whatever else runs on the machine (other people's load lengthens the wall time only). A process that ends orphaned
(reparented to init before it was reaped) takes its time with it, so CPU is a lower bound.

A thread samples, every 50 ms, the scheduler state of every thread of the tree: ``idle`` is the time no thread was
runnable nor in a disk wait (the test kept no core busy: sleeps, timeouts, servers starting, waits on a clock),
``disk`` the time only disk waits were; a thread runnable but waiting for a core counts as busy, so other people's
load does not show as idle. The table at the end, one row per file, most idle first: wall, CPU, ``wall - CPU``
(idle plus the time spent waiting for a core on a loaded machine; below zero where two ranks ran at once), idle
and disk. With ``PYTEST_CPU_OUT`` each test's numbers are appended there as it ends, a JSON line each.
Under xdist each worker measures its own tests and writes ``PYTEST_CPU_OUT.gwN``; the table needs ``-n 0``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_times(pid: int) -> tuple[float, int] | None:
    """(user + system + children's user + system seconds, parent pid) of ``pid`` from /proc, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15), counted from state as 0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK, int(fields[1])


def tree_cpu(root: int | None = None) -> float:
    """CPU seconds used so far by ``root`` (this process) and every live descendant, reaped children included."""
    root = os.getpid() if root is None else root
    times: dict[int, float] = {}
    parents: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _proc_times(int(entry))
            if got is not None:
                times[int(entry)] = got[0]
                parents[got[1]].append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(parents.get(pid, ()))
    return total


def _tree_states(root: int, skip_tid: int) -> str:
    """The scheduler state letter of every thread of ``root`` and its descendants (but ``skip_tid``)."""
    states, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if int(tid) == skip_tid:
                continue
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return "".join(states)


class Sampler(threading.Thread):
    """Every ``interval`` s, whether any thread of this process's tree is runnable (R) or in uninterruptible sleep (D,
    disk): the samples with neither are time the test kept no core busy, however loaded the machine (a runnable
    thread waiting for a core counts as busy)."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="pytest-cpu-sampler")
        self.interval, self.counts = interval, [0, 0, 0]  # samples, idle, disk only
        self._done = threading.Event()

    def run(self) -> None:
        root, me = os.getpid(), threading.get_native_id()
        while not self._done.wait(self.interval):
            states = _tree_states(root, me)
            self.counts[0] += 1
            if "R" not in states:
                self.counts[1 if "D" not in states else 2] += 1

    def stop(self) -> tuple[int, int, int]:
        self._done.set()
        self.join()
        return tuple(self.counts)


class CpuRecorder:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, dict[str, float]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        sampler = Sampler()
        wall, cpu = time.monotonic(), tree_cpu()
        sampler.start()
        yield
        samples, idle, disk = sampler.stop()
        wall, cpu = time.monotonic() - wall, tree_cpu() - cpu
        share = wall / samples if samples else 0.0
        self.tests[item.nodeid] = {"wall": wall, "cpu": cpu, "idle": idle * share, "disk": disk * share}
        out = os.environ.get("PYTEST_CPU_OUT")
        if out:  # a line per test as it ends: a run cut short keeps what it measured
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            with open(f"{out}.{worker}" if worker else out, "a") as fh:
                fh.write(json.dumps({"test": item.nodeid, **{k: round(v, 3) for k, v in self.tests[item.nodeid].items()}})
                         + "\n")

    def by_file(self) -> list[tuple[str, dict[str, float]]]:
        files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for nodeid, t in self.tests.items():
            row = files[nodeid.split("::", 1)[0]]
            for key, value in t.items():
                row[key] += value
            row["tests"] += 1
        return sorted(files.items(), key=lambda kv: kv[1]["idle"], reverse=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = self.by_file()
        if not rows:
            return
        tr = terminalreporter
        head = f"{'wall':>8} {'cpu':>8} {'wall-cpu':>8} {'idle':>8} {'disk':>6} {'tests':>5}"

        def line(t: dict[str, float], name: str, tests: str = "") -> str:
            return (f"{t['wall']:8.1f} {t['cpu']:8.1f} {t['wall'] - t['cpu']:8.1f} {t['idle']:8.1f} {t['disk']:6.1f} "
                    f"{tests:>5}  {name}")

        tr.section("wall and CPU seconds by file, most idle first (idle: nothing of the test runnable)")
        tr.write_line(f"{head}  file")
        for name, t in rows:
            tr.write_line(line(t, name, str(int(t["tests"]))))
        total = {k: sum(t[k] for _, t in rows) for k in ("wall", "cpu", "idle", "disk")}
        tr.write_line(line(total, "(all)", str(len(self.tests))))
        tr.section("tests idle the longest")
        tr.write_line(f"{head}  test")
        for nodeid, t in sorted(self.tests.items(), key=lambda kv: kv[1]["idle"], reverse=True)[:25]:
            tr.write_line(line(t, nodeid))


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuRecorder(config), "pytest_cpu_recorder")
