"""Shared fixtures: tiny Step3.5 models generated once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from stepmtp.tiny import write_tiny_models


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths of the tiny model variants (embedded, trunk, mtp, broken, nomtp)."""
    return write_tiny_models(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def embedded_model(tiny):
    from stepmtp import Model

    m = Model(tiny["embedded"])
    yield m
    m.close()
