"""Session fixtures for integration tests (processes are launched): the embedded bases, straight runs, an S3 server."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The warm launcher's server (harness.py) ends with the session and is reaped by this process, so that the CPU
    of every command it forked counts in this process's children (``time`` of the suite), not in init's."""
    from tests.integration import harness

    if harness._warm_launcher.cache_info().currsize:
        harness._warm_launcher().close()


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder where the embedded tiny base model is created once and shared by every run."""
    from automodel_ckpt.models.tiny import ensure_tiny_base

    root = tmp_path_factory.mktemp("assets")
    ensure_tiny_base(root / "tiny_llama_base")
    return root


@pytest.fixture(scope="session")
def vlm_base(assets: Path) -> Path:
    """The embedded tiny image-text base (a LLaVA layout), created once beside the text base."""
    from automodel_ckpt.models.tiny_vlm import ensure_tiny_vlm_base

    return ensure_tiny_vlm_base(assets / "tiny_llava_base")


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory: pytest.TempPathFactory, assets: Path):
    """The default recipe's straight 8-step runs (shared_runs.py), trained once per session on each process count."""
    from tests.integration.shared_runs import StraightRuns, session_folder

    return StraightRuns(session_folder(tmp_path_factory), assets)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    """One real S3 server (SeaweedFS on loopback) for the whole session; each test makes its own bucket."""
    from tests.integration.seaweed import start

    server = start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()
