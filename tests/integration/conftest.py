"""Shared fixtures for integration tests (processes are launched): one embedded base model for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder where the embedded tiny base model is created once and shared by every run."""
    from automodel_ckpt.models.tiny import ensure_tiny_base

    root = tmp_path_factory.mktemp("assets")
    ensure_tiny_base(root / "tiny_llama_base")
    return root


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    """One real S3 server (SeaweedFS on loopback) for the whole session; each test makes its own bucket."""
    from tests.integration.seaweed import start

    server = start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()
