"""Suite-wide test options: slow tests run only with RUN_SLOW=1; `-n auto` picks the worker count; the files of
long multi-process runs are handed to the workers first; the garbage collector runs less often."""

from __future__ import annotations

import gc
import os

import pytest

import automodel_ckpt.algorithms  # noqa: F401 - registers the algorithms' recipe sections, as the CLI does


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per two CPUs, at least two and at most eight (an end-to-end test runs two ranks).
    On 2 CPUs a third worker did not shorten the whole suite: the cores are already busy."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


#: Test files whose runs take minutes: given to the workers first (longest first), so that they run side by side
#: and the many short tests fill in at the end, instead of one long file running alone at the end. The 3- and 4-rank
#: resume chains are the longest file (ten cases of four launches each); the strategy, MLflow-outage and streaming
#: chains of a minute each follow the default recipe's learning test.
LONG_FILES = ("test_resume_ranks.py", "test_vlm.py", "test_object_store.py", "test_resume_heals.py",
              "test_parallelism.py", "test_peft.py", "test_pipeline.py", "test_checkpoint_core.py", "test_families.py",
              "test_async_preemption.py", "test_train.py", "test_data_parallel_choice.py", "test_tracker_outage.py",
              "test_streaming.py", "test_bench_tools.py", "test_expert_parallel.py", "test_world_size_change.py",
              "test_meta_build.py", "test_same_seed.py", "test_consolidation_e2e.py", "test_fast_recovery.py",
              "test_kill_fault.py", "test_run_guard.py")


def pytest_configure(config: pytest.Config) -> None:
    # the garbage collector's passes, less often: each worker's heap (torch, transformers, DeepSpeed ...) grows
    # through the run, and the full passes over it took 18.8 of the unit tests' 105 s (4.4 s with these thresholds)
    gc.set_threshold(100_000, 50, 50)
    if hasattr(config.option, "loadscopereorder"):  # xdist's default: files with the most tests first
        config.option.loadscopereorder = False


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives to the end: frozen out of the garbage collector's passes (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def _cost_order(item: pytest.Item) -> tuple[int, int]:
    name = os.path.basename(str(item.fspath))
    if name in LONG_FILES:
        return 0, LONG_FILES.index(name)
    return (1 if "/integration/" in str(item.fspath) else 2), 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_cost_order)  # stable: each file's tests keep their order
    if os.environ.get("RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow; set RUN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def family_bases(tmp_path_factory: pytest.TempPathFactory):
    """Tiny bf16 bases of every family in tests/family_bases.py, built once per session (two weight files each)."""
    from tests.family_bases import FAMILIES, build_family_base

    root = tmp_path_factory.mktemp("family_bases")
    return {family: build_family_base(family, root / family) for family in FAMILIES}
