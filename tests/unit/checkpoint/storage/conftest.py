"""The object store the storage contract runs against: one real S3 server (SeaweedFS) per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    from tests.integration.seaweed import start

    server = start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()
