"""tools/bench_checkpoint.py: its raw I/O baselines move the bytes they claim, sizes match the request, and the
report's ratios are computed the right way round."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_checkpoint.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("writers,threads", [(1, 1), (2, 1), (1, 3), (2, 4)])
def test_raw_write_and_read_move_exactly_the_bytes(bench, tmp_path, monkeypatch, writers, threads):
    monkeypatch.setattr(bench, "BLOCK", 4096)
    nbytes = 10 * 4096 + 123  # not a multiple of the block, nor of the writers
    bench.raw_write(tmp_path, nbytes, writers, threads)
    files = sorted(tmp_path.glob("raw_*.bin"))
    assert len(files) == writers
    assert sum(f.stat().st_size for f in files) == nbytes
    assert bench.raw_read(tmp_path, writers, threads) == nbytes  # into memory of the file's size
    assert bench.raw_read(tmp_path, writers, threads, keep=False) == nbytes  # through one reused buffer


@pytest.mark.parametrize("size_gb", [0.25, 1.0, 4.0])
def test_state_size_follows_the_request(bench, size_gb):
    _, nbytes = bench.payload_bytes(bench.layers_for(size_gb))
    assert abs(nbytes / 1e9 - size_gb) / size_gb < 0.25


def test_table_ratios_are_reference_time_over_method_time(bench, capsys):
    def row(median):
        return bench.stats([median, median * 0.9, median * 1.2], 2_000_000_000) | {"extra_rss_mb": 10.0}

    result = {
        "size_gb": 2.0, "nproc": 1, "device": "cpu", "reps": 3, "page_cache_dropped": True, "torch": "x",
        "machine": {"cpu_count": 2, "load_average_before": [0.5], "load_average_after": [0.7]},
        "methods": {"raw_write": row(2.0), "raw_write_mt": row(1.6), "dcp_save": row(3.0),
                    "ours_save_safetensors": row(1.0), "raw_read": row(1.0), "ours_load_safetensors": row(2.0),
                    "ours_consolidate": row(1.0)},
    }
    bench.print_table(result)
    out = capsys.readouterr().out
    ours_save = next(line for line in out.splitlines() if "save | **ours, safetensors**" in line)
    cells = [c.strip() for c in ours_save.split("|")]
    assert cells[3:7] == ["1.000", "0.900", "1.200", "2.00"]  # median, min, max, GB/s
    assert cells[7:10] == ["2.00×", "1.60×", "3.00×"]  # vs raw, vs raw with threads, vs dcp.save
    ours_load = next(line for line in out.splitlines() if "load | **ours, safetensors**" in line)
    assert [c.strip() for c in ours_load.split("|")][7] == "0.50×"
    assert "torch.save" not in out  # methods that did not run have no row
    assert "| HF export | **ours** (fsync) |" in out
    assert "| pack |" not in out  # nor a section of which only the reference ran (the export is not a pack)


def test_size_outside_the_range_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--size-gb", "8", "--dir", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--size-gb: between 0.25 and 4" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_a_method_outside_the_groups_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--only", "save", "--methods", "raw_write_direct,ours_load_safetensors",
                           "--dir", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--methods: ours_load_safetensors not among the methods of --only save" in proc.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("writers,threads", [(1, 1), (2, 3)])
def test_direct_write_and_read_move_exactly_the_bytes(bench, tmp_path, monkeypatch, writers, threads):
    if not bench.direct_io_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(bench, "BLOCK", 4 * 4096)
    nbytes = 10 * 4096 + 123  # an unaligned tail goes through the buffered descriptor
    bench.raw_write(tmp_path, nbytes, writers, threads, direct=True)
    files = sorted(tmp_path.glob("raw_*.bin"))
    assert len(files) == writers and sum(f.stat().st_size for f in files) == nbytes
    assert bench.raw_read(tmp_path, writers, threads, direct=True) == nbytes
    assert bench.raw_read(tmp_path, writers, threads, keep=False, direct=True) == nbytes


def test_resume_rows_split_the_launch_and_compare_with_a_fresh_start(capsys):
    spec = importlib.util.spec_from_file_location("bench_resume", TOOL.parent / "bench_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.print_rows({"format": "safetensors", "ratio": 12.0 / 10.0, "fork_over_exec": 10.0 / 16.0,
                       "fresh": {"data": 8.0, "first_step": 10.0}, "resume": {"data": 8.5, "loading": 9.0,
                                                                               "first_step": 12.0},
                       "exec": {"data": 14.0, "first_step": 16.0}})
    out = capsys.readouterr().out
    fresh = next(line for line in out.splitlines() if line.startswith("| fresh start"))
    resume = next(line for line in out.splitlines() if line.startswith("| **resume**"))
    assert [c.strip() for c in fresh.split("|")][2:7] == ["10.00", "8.00", "–", "2.00", "1.00×"]
    assert [c.strip() for c in resume.split("|")][2:7] == ["12.00", "8.50", "0.50", "3.00", "**1.20×**"]
    exec_row = next(line for line in out.splitlines() if "--start-method exec" in line)
    assert [c.strip() for c in exec_row.split("|")][2:7] == ["16.00", "14.00", "–", "2.00", "1.60×"]


def test_mesh_rows_compare_each_mesh_with_dp(bench, capsys):
    def row(median):
        return bench.stats([median], 1_000_000_000) | {"extra_rss_mb": 1.0}

    result = {
        "size_gb": 1.0, "nproc": 4, "device": "cpu", "reps": 1, "page_cache_dropped": True, "torch": "x",
        "machine": {}, "bytes_on_disk": {"mesh_save_hsdp": 250_000_000},
        "methods": {"raw_write": row(2.0), "mesh_save_dp": row(1.0), "mesh_save_dp_tp": row(0.5),
                    "mesh_save_hsdp": row(2.0), "raw_read": row(1.0), "mesh_load_dp_tp": row(1.0)},
    }
    bench.print_table(result)
    out = capsys.readouterr().out
    tp = next(line for line in out.splitlines() if "save on a mesh | **ours, safetensors, dp 2 × tp 2**" in line)
    assert [c.strip() for c in tp.split("|")][7:10] == ["4.00×", "–", "2.00×"]  # vs raw, same threads, vs dp 4
    assert "ours, safetensors, HSDP 2 × 2 put 0.250 GB on disk" in out
    assert "load on a mesh | **ours, safetensors, dp 2 × tp 2**" in out


def test_a_run_past_its_time_is_stopped_with_its_stack_and_named(bench, tmp_path):
    """--child-timeout: a run with no result in time gets SIGABRT (its stack printed by faulthandler), the whole
    process group goes, and the failure names the method; the bench goes on with the others."""
    import argparse

    args = argparse.Namespace(dir=tmp_path, nproc=1, device="cpu", baseline_tree=None, child_timeout=0.3)
    with pytest.raises(bench.ChildFailed) as failed:  # importing torch alone takes longer
        bench.run_child("raw_write", args, 1, 4096)
    message = str(failed.value)
    assert message.startswith("raw_write: no result after 0.3 s; where it stood:")
    assert "File " in message  # the child's Python stack
