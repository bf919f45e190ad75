"""Shared fixtures: tiny Step3.5 models generated once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# One llama.cpp thread per engine: the suite runs servers and engines side by side on
# small shared machines, where two spinning threads per process starve each other.
os.environ.setdefault("STEPMTP_N_THREADS", "1")
# huggingface_hub (stepmtp.hub) reads these when imported: the suite never reaches the
# network (a dead local port for the hub; tests/hub_stub.py stands in where one is needed)
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

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
