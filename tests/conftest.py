"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qwengyre.models import cached_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the offline "test"-size tiny model (built once, shared by xdist workers).

    Cached under ``$QWENGYRE_CACHE`` if set, else next to pytest's base temp dir (the parent
    of each xdist worker's base temp), so all workers of a session reuse one build.
    """
    env = os.environ.get("QWENGYRE_CACHE")
    cache_dir = Path(env) if env else tmp_path_factory.getbasetemp().parent / "qwengyre-models"
    return cached_tiny_model("test", cache_dir=cache_dir)
