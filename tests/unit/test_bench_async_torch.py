"""tools/bench_async_torch.py: the staging comparison takes the steady-state saves of every repetition and the step
after each, its ratios are torch over ours, and it is empty unless both contenders ran (no launch: recorded runs
are made up here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_async_torch", TOOLS / "bench_async_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(blocked: float, durable: float, rss: int, step: float = 1.0) -> dict:
    """Saves after steps 1, 2 and 3 (the final one): the first (allocates its copy: slow, left out) and the final
    one are not steady state. The step after the steady one (step 3) takes ``step`` seconds, with the background
    busy."""
    saves = [{"step": 1, "stall": 9.0, "call": 9.0, "fence": 0.0, "durable": 9.0, "final": False},
             {"step": 2, "stall": blocked, "call": blocked / 2, "fence": blocked / 2, "durable": durable,
              "capture": blocked, "final": False},
             {"step": 3, "stall": 9.0, "call": 9.0, "fence": 0.0, "durable": None, "final": True}]
    steps = [{"seconds": 5.0, "background": False}, {"seconds": 2.0, "background": True},
             {"seconds": step, "background": True}]
    return {"saves": saves, "steps": steps, "peak_rss_bytes": rss}


def test_compare_takes_steady_saves_and_reports_torch_over_ours(bench):
    results = {"none": [{"saves": [], "peak_rss_bytes": 100 << 20}],
               "async": [_run(0.2, 2.0, 300 << 20), _run(0.4, 4.0, 300 << 20)],
               "torch_stager": [_run(0.1, 6.0, 400 << 20, 3.0), _run(0.1, 6.0, 400 << 20, 3.0)]}
    cmp = bench.compare(results)
    assert cmp["async"]["blocked"] == pytest.approx(0.3) and cmp["async"]["durable"] == pytest.approx(3.0)
    assert cmp["async"]["fence"] == pytest.approx(0.15) and cmp["torch_stager"]["call"] == pytest.approx(0.05)
    assert cmp["async"]["peak_rss_over_none"] == 200 << 20 and cmp["torch_stager"]["peak_rss_over_none"] == 300 << 20
    assert cmp["async"]["next_step"] == 1.0 and cmp["torch_stager"]["next_step"] == 3.0  # the step after step 2
    assert cmp["async"]["first_next_step"] == 2.0 and cmp["async"]["busy_step"] == 1.5
    assert cmp["torch_over_ours"] == {"blocked": pytest.approx(1 / 3), "durable": pytest.approx(2.0),
                                      "next_step": pytest.approx(3.0), "peak_rss_over_none": pytest.approx(1.5)}
    table = bench.compare_table(cmp, {"run_overhead_async": 0.1, "run_overhead_torch_stager": 0.2})
    assert "| ours (`async`) | 0.300 | 0.150 | 0.300 | 3.000 | 1.000 | 2.000 | 1.500 | +200 | +10.0% |" in table
    assert "training blocked 0.33, until durable 2.00, step after a save 3.00" in table


def test_compare_is_empty_without_both_contenders(bench):
    assert bench.compare({"none": [], "async": [_run(0.2, 2.0, 1)]}) == {}
    assert bench.compare({"async": [_run(0.2, 2.0, 1)], "torch_stager": [{"failed": "boom"}]}) == {}
    assert bench.compare_table({}, {}) == ""
