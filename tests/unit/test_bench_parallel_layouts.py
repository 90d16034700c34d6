"""tools/bench_parallel.py's layouts are ones the trainer accepts on their process counts, and its report's ratios
and goal line come from the right reference runs (no launch: the sizes are resolved as the recipe resolves them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from automodel_ckpt.distributed.mesh import resolve_pipeline, resolve_sizes

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bench():
    """The tool as a module (the tools are not a package; it finds ``bench_memory`` beside itself)."""
    spec = importlib.util.spec_from_file_location("bench_parallel", TOOLS / "bench_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(args: tuple[str, ...]) -> dict[str, str]:
    return {args[i].removeprefix("--"): args[i + 1] for i in range(0, len(args), 2)}


@pytest.mark.parametrize("layout", ["dp1", "dp4", "pp4", "pp4-gpipe", "pp4-interleaved", "pp2dp2", "pp2tp2", "pp2",
                                    "moe-dp4", "ep2dp2"])
def test_each_layout_resolves_to_its_sizes_on_its_processes(bench, layout):
    label, base, nproc, pp, tp, ep, schedule = bench.LAYOUTS[layout]
    keys = _keys(bench.overrides(layout))
    section = {k.removeprefix("distributed."): int(v) if v.isdigit() else v
               for k, v in keys.items() if k.startswith("distributed.")}
    sizes = resolve_sizes(section, nproc)
    assert (sizes.pp, sizes.tp, sizes.ep, sizes.world_size) == (pp, tp, ep, nproc)
    assert label.split(" (")[0].split(",")[0] == sizes.describe()  # the trainer's own name for the layout
    local = int(keys["step_scheduler.local_batch_size"])
    assert local * (nproc // (pp * tp)) == int(keys["step_scheduler.global_batch_size"]) == bench.GLOBAL_BATCH
    if pp > 1:
        layers = bench.dense_config(bench.bench_memory.parse_size("300MB"))["num_hidden_layers"]
        plan = resolve_pipeline(section, sizes, local, num_layers=layers)
        assert (plan.schedule, plan.microbatches) == (schedule, pp)
    if base == "moe":
        assert bench.EXPERTS % ep == 0


@pytest.mark.parametrize("size", ["20MB", "300MB", "1GB"])
def test_the_dense_base_splits_into_four_even_stages(bench, size):
    layers = bench.dense_config(bench.bench_memory.parse_size(size))["num_hidden_layers"]
    assert layers >= 4 and layers % 4 == 0


def _run(bench, layout: str, peak_mib: float, step: float = 1.0) -> dict:
    label, base, nproc, *_ = bench.LAYOUTS[layout]
    return {"layout": layout, "label": label, "base": base, "nproc": nproc, "step_seconds": step,
            "step_cpu_seconds": 0.5, "whole_added_max": peak_mib * (1 << 20)}


@pytest.mark.parametrize("pp4_mib,verdict", [(300, "0.300 PASS"), (400, "0.400 FAIL")])
def test_ratios_against_each_bases_reference_and_the_goal_line(bench, pp4_mib, verdict):
    runs = {"dp1": _run(bench, "dp1", 1000), "pp4": _run(bench, "pp4", pp4_mib, 2.0),
            "pp4-gpipe": _run(bench, "pp4-gpipe", 500, 3.0), "pp4-interleaved": _run(bench, "pp4-interleaved", 350, 1.5),
            "moe-dp4": _run(bench, "moe-dp4", 800),
            "ep2dp2": _run(bench, "ep2dp2", 400), "dp4": {**_run(bench, "dp4", 0), "failed": "x"}}
    bench.add_ratios(runs)
    assert runs["ep2dp2"]["peak_ratio"] == pytest.approx(0.5)  # against the MoE base's dp 4, not the dense dp 1
    assert "peak_ratio" not in runs["dp4"]
    lines = bench.summary(runs)
    assert lines[0] == (f"pp 4 step time: 1f1b 2.00 s, gpipe 3.00 s (1.50×), interleaved_1f1b 1.50 s (0.75×); peak "
                        f"above idle: 1f1b {pp4_mib} MiB, gpipe 500 MiB, interleaved_1f1b 350 MiB")
    assert lines[1].endswith(verdict)
    assert lines[2].startswith("dp 4 failed")
    assert "| dp 4 × ep 2, MoE | 4 | 1.00 | 0.50 | 400 | 0.500 | dp 4, MoE |" in bench.table(runs)
