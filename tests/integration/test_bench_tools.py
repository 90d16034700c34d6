"""tools/bench_async.py, bench_scale.py, bench_memory.py, bench_recovery.py and bench_train.py in their small modes:
they run, and their reports hold what they promise (the ratios, every phase at every rank count, each recovery's
tier, every contender's step times). Correctness of the output, not speed."""

from __future__ import annotations

import importlib
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(tool: str, *args: str, timeout: int = 900) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def _main(tool: str, *args: str, capsys, monkeypatch) -> str:
    """``tools/TOOL.py ARGS`` through its ``main`` in this process (which has imported what it imports: torch,
    the package's recipe) instead of a new interpreter; what it printed. Its runs are still processes of their own.
    A ``main()`` without parameters reads ``sys.argv``."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))  # the tools import their siblings from their folder
    main = importlib.import_module(tool).main
    monkeypatch.setattr(sys, "argv", [str(TOOLS / f"{tool}.py"), *args])
    capsys.readouterr()
    main(list(args)) if main.__code__.co_argcount else main()
    return capsys.readouterr().out


def test_bench_async_small_reports_stall_and_run_overhead(tmp_path, capsys, monkeypatch):
    out = tmp_path / "async.json"
    printed = _main("bench_async", "--small", "--nproc", "1", "--modes", "none,sync,async", "--json", str(out),
                    capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out.read_text())
    assert math.isfinite(report["stall_over_sync"]) and report["stall_over_sync"] > 0
    assert report["stall_over_sync"] == pytest.approx(report["async_stall_seconds"] / report["sync_save_seconds"])
    for mode in ("sync", "async"):
        lost = report[f"run_overhead_{mode}"]
        assert math.isfinite(lost) and lost < 1 and math.isfinite(report[f"cpu_per_checkpoint_{mode}"])
        [run] = report["runs"][mode]  # one repetition in the small mode
        assert [s["step"] for s in run["saves"]] == [2, 4, 5] and run["saves"][-1]["final"]
        assert len(run["steps"]) == 5 and run["cpu_seconds"] > 0
        # the kernel's per-thread accounting: the training thread's share and the rest of the process's add up
        assert 0 < run["training_thread_cpu_seconds"] <= run["cpu_seconds"]
        others = run["cpu_seconds"] - run["training_thread_cpu_seconds"]
        assert run["other_threads_cpu_seconds"] == pytest.approx(others)
        low, high = report[f"run_overhead_spread_{mode}"]  # one repetition: its loss is the median's
        steps = run["steps"]  # whole save cycles: the end of step 2 (saved next) to the end of step 4 (before its save)
        assert run["steady_steps_per_second"] == pytest.approx(2 / (steps[3]["end"] - steps[1]["end"]))
        assert report[f"steady_overhead_spread_{mode}"] == [pytest.approx(report[f"steady_overhead_{mode}"])] * 2
        window = [x["seconds"] for x in steps[2:4]]  # within the run: the cycle's steps above their median, the call
        typical, call = statistics.median(window), run["saves"][0]["call"]
        assert run["excess_seconds_per_cycle"] == pytest.approx(sum(x - typical for x in window) + call)
        [none] = report["runs"]["none"]
        cost = (run["excess_seconds_per_cycle"] - none["excess_seconds_per_cycle"]) / (2 * none["typical_step_seconds"])
        assert report[f"within_run_cost_{mode}"] == pytest.approx(cost)
        assert report[f"within_run_cost_spread_{mode}"] == [pytest.approx(cost)] * 2
        assert low == high == pytest.approx(lost) and math.isfinite(report[f"background_cpu_per_checkpoint_{mode}"])
    for save in report["runs"]["async"][0]["saves"]:
        assert save["stall"] == pytest.approx(save["call"] + save["fence"]) and save["fence"] >= 0
        assert save["capture"] is not None and save["background"] is not None  # the copy and write were timed
    sync_call = min(s["call"] for s in report["runs"]["sync"][0]["saves"])  # a save's work, against none at all
    assert all(s["background"] is None and s["call"] < sync_call for s in report["runs"]["none"][0]["saves"])
    assert "stall_over_sync (median, steady state)" in printed and "| async |" in printed
    assert "of which off the training thread" in printed and "steady state: lost" in printed
    assert "within the runs: lost" in printed
    parts = report["stall_parts"]  # what the stall is made of, each a median of the steady-state saves
    assert {"snapshot", "small_files", "hand_off", "fence", "other"} <= set(parts)
    assert all(math.isfinite(v) and v >= 0 for v in parts.values()) and "stall parts" in printed


def test_bench_scale_small_reports_every_phase_per_rank_count(tmp_path, capsys, monkeypatch):
    out = tmp_path / "scale.json"
    printed = _main("bench_scale", "--small", "--json", str(out), capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out.read_text())
    assert report["ranks"] == [2, 3]
    for phase in ("reserve", "plan_local", "plan_global", "write_sharded", "manifest", "publish", "save", "load"):
        row = report["phases"][phase]
        assert set(row) == {"2", "3"} and all(v >= 0 for v in row.values()), phase
        assert phase in report["growth"]
    sent = report["phases"]["object_bytes"]  # what object collectives moved per rank and save: plans, checksums
    assert 0 < sent["2"] < sent["3"] <= 1.5 * 1.5 * sent["2"]  # no faster than the rank count
    assert sent["3"] < 1 << 20  # metadata-sized
    assert "| manifest (s) |" in printed


def test_bench_memory_small_reports_the_setup_peak_against_the_ranks_share(tmp_path, capsys, monkeypatch):
    out = tmp_path / "memory.json"
    printed = _main("bench_memory", "--size", "20MB", "--nprocs", "1", "--steps", "1", "--work", str(tmp_path),
                    "--activation-checkpointing", "off", "--json", str(out), capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out.read_text())
    [run] = [r for r in report["runs"] if not r["activation_checkpointing"]]
    [rank] = run["ranks"]
    assert rank["base_bytes_read"] == report["size_bytes"]  # one rank: the whole base, read once
    assert rank["idle"] < rank["setup_peak"] <= rank["steps_peak"] and run["first_step_seconds"] > 0
    assert rank["params_share"] == 4 * rank["local_params"] and run["setup_goal_met"]  # <= 1.25 x share + 256 MiB
    assert "setup peak MiB" in printed


def test_bench_memory_setup_only_stops_before_the_first_step(tmp_path, capsys, monkeypatch):
    out = tmp_path / "memory.json"
    printed = _main("bench_memory", "--size", "20MB", "--nprocs", "1", "--steps", "0", "--work", str(tmp_path),
                    "--activation-checkpointing", "off", "--json", str(out), capsys=capsys, monkeypatch=monkeypatch)
    [run] = [r for r in json.loads(out.read_text())["runs"] if not r["activation_checkpointing"]]
    [rank] = run["ranks"]
    assert "steps_peak" not in rank and rank["steps_over_state"] is None  # no step was taken
    assert rank["idle"] < rank["setup_peak"] and rank["base_bytes_read"] > 0
    assert "setup done" in printed


@pytest.mark.slow  # five two-node launches (1.5 to 4 min here); tests/integration/test_fast_recovery.py covers the tiers
@pytest.mark.parametrize("store", ["disk", "s3"])  # s3: the durable tier on a SeaweedFS server the tool starts
def test_bench_recovery_small_kills_a_node_and_resumes_from_each_tier(tmp_path, store):
    out = tmp_path / "recovery.json"
    printed = _run("bench_recovery.py", "--small", "--durable-store", store, "--json", str(out))
    report = json.loads(out.read_text())
    assert report["durable_store"] == store and report["durable_checkpoint_bytes"] > 0
    local, durable = report["rerun_local"], report["rerun_durable"]
    assert local["tier"] == ["local"] and durable["tier"] == ["durable"]
    assert durable["resumed_step"] < local["resumed_step"] < report["kill_after"]  # the local step is newer
    assert 0 < local["steps_lost"] <= report["local_every"] < durable["steps_lost"]
    assert local["losses_match"] and durable["losses_match"]  # as the run that was never killed
    assert not local["page_cache_dropped"]  # the small mode leaves the machine's page cache alone
    for rerun in (local, durable):
        assert rerun["load_seconds"] > 0 and 0 < rerun["detect_seconds"] < rerun["kill_to_step_seconds"]
        assert rerun["kill_to_step_seconds"] == pytest.approx(rerun["detect_seconds"] + rerun["restart_seconds"])
    assert set(local["restore_phases"]) >= {"local_find_and_verify", "local_make_whole", "local_load"}
    assert "durable_load" in durable["restore_phases"]
    for key in ("stall_local_over_durable", "run_overhead_local", "run_overhead_durable", "load_durable_over_local"):
        assert math.isfinite(report[key]), key
    assert report["stall_local_over_durable"] > 0 and report["run_overhead_local"] < 1
    [rep] = report["runs"]
    assert [s["step"] for s in rep["local"]["local"]] == [2, 6]  # every 2 steps, not at the durable step 4
    assert [s["step"] for s in rep["durable"]["saves"]] == [2, 4, 6, 8]
    for save in rep["local"]["local"] + rep["durable"]["saves"]:
        assert save["stall"] == pytest.approx(save["call"] + save["fence"]) and save["background"] is not None
    state = report["state_bytes"]  # each node keeps its own part and a copy of the other's: twice the state
    assert report["local_bytes_peak"] >= report["local_bytes_at_kill"] >= 2 * state
    assert "| from the local tier | local |" in printed and "local stall / durable stall" in printed


def test_bench_train_tiny_times_every_contender(tmp_path, capsys, monkeypatch):
    out = tmp_path / "train.json"
    printed = _main("bench_train", "--sizes", "tiny", "--nprocs", "1", "--steps", "3", "--reps", "1",
                    "--work", str(tmp_path / "work"), "--json", str(out), capsys=capsys, monkeypatch=monkeypatch)
    report = json.loads(out.read_text())
    [group] = report["results"]
    assert (group["size"], group["nproc"]) == ("tiny", 1) and report["sizes"]["tiny"]["parameters"] > 0
    assert set(group["contenders"]) == {"ours", "hf", "bare"}
    for name, contender in group["contenders"].items():
        assert "failed" not in contender, contender.get("failed")
        [run] = contender["runs"]
        assert len(run["step_seconds"]) == 3 and all(t > 0 for t in run["step_seconds"]), name
        assert contender["step_seconds_median"] > 0 and contender["tokens_per_s"] > 0
        assert all(peak > 0 for peak in contender["peak_rss_bytes_per_rank"])
    assert group["contenders"]["hf"]["runs"][0]["optim"] == "adamw_torch_fused"  # the Trainer's default
    assert group["bare_best"] == "bare" and group["ours_speed_over_hf"] > 0 and group["ours_speed_over_bare_best"] > 0
    assert "| tiny | 1 |" in printed and "speed ours/HF" in printed
