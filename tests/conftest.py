"""Suite-wide test options: slow tests run only with RUN_SLOW=1; `-n auto` picks the worker count."""

from __future__ import annotations

import os

import pytest


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per two CPUs, at least two and at most eight (an end-to-end test runs two ranks)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
