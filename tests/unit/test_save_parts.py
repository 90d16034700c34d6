"""tools/save_parts.py: a py-spy profile's samples put in the save's parts by their innermost named frame, the
processes above a rank and threads waiting in C left out (no launch: the profile is made up here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
RANK = 'process 10:"python -m automodel_ckpt";process 11:"python -m automodel_ckpt"'


@pytest.fixture(scope="module")
def parts():
    spec = importlib.util.spec_from_file_location("save_parts", TOOLS / "save_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(thread: str, *frames: str, count: int = 1) -> str:
    return ";".join((RANK, f"thread (12): {thread}", *frames)) + f" {count}"


def test_samples_go_to_the_innermost_part_named(parts, tmp_path):
    fsync_line = next(n for n, text in enumerate((TOOLS.parent / "automodel_ckpt/ondisk/fastio/filewrite.py")
                                                 .read_text().splitlines(), 1) if "os.fsync(fd)" in text)
    raw = tmp_path / "run.raw"
    raw.write_text("\n".join([
        _line("MainThread", "train (loop.py:1)", "forward (model.py:2)", count=300),
        _line("MainThread", "train (loop.py:1)", "save_checkpoint (recipe.py:3)", "capture (writer.py:4)", count=5),
        _line("ckpt-async", "run (overlap.py:1)", "write_file (filewrite.py:9)", "_pwrite_all (filewrite.py:95)",
              count=20),
        _line("ckpt-async", "run (overlap.py:1)", f"write_file (filewrite.py:{fsync_line})", count=7),
        _line("ckpt-hash_0", "_worker (thread.py:1)", "_Hasher.feed (filewrite.py:1)", count=4),
        _line("ckpt-async", "run (overlap.py:1)", "collectively (collective.py:1)", "all_gather (c10d.py:1)",
              count=6),
        _line("ckpt-async", "run (overlap.py:1)", "_prune (writer.py:1)", "rmtree (shutil.py:1)", count=2),
        _line("ckpt-async", "Thread.run (threading.py:1)", "BackgroundThread._serve (overlap.py:101)", count=500),
        _line("ckpt-write_0", "Thread.run (threading.py:1)", "_worker (thread.py:81)", count=500),
        _line("pt_data_worker", "loop (worker.py:1)", "fetch (worker.py:2)", count=10),
    ]) + "\n")
    found = parts.parts(raw, rate=100)
    assert found["training"] == pytest.approx(3.10)  # the data loader's thread counts as training's
    assert (found["snapshot"], found["write"], found["fsync"]) == pytest.approx((0.05, 0.20, 0.07))
    assert (found["checksums"], found["coordination"], found["retention"]) == pytest.approx((0.04, 0.06, 0.02))
    assert sum(found.values()) == pytest.approx(3.54)  # the idle waits are left out
