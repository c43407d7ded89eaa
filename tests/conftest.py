"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
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


CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
"""The real Claude Code CLI the harness tests install with npm (pinned)."""
QWEN_CODE = "@qwen-code/qwen-code@0.24.4"
"""The real Qwen Code CLI the harness tests install with npm (pinned)."""
OPENCODE = "opencode-ai@1.18.33"
"""The real OpenCode CLI the harness tests install with npm (pinned; its platform binary
comes as an optional dependency)."""


def npm_bin(factory: pytest.TempPathFactory, package: str, folder: str, binary: str) -> Path:
    """``binary`` of the npm ``package`` (pinned), installed once into ``folder`` of a
    cache (``$QWENGYRE_NPM_CACHE``, else next to pytest's base temp); skips, saying why,
    when node/npm are missing or the install fails."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"node and npm are needed to run {package}")
    prefix = Path(os.environ.get("QWENGYRE_NPM_CACHE", factory.getbasetemp().parent)) / folder
    path = prefix / "node_modules" / ".bin" / binary
    if not path.exists():
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), package],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not path.exists():
            pytest.skip(f"npm could not install {package}: {done.stderr.strip()[-300:]}")
    return path


@pytest.fixture(scope="session")
def claude_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, CLAUDE_CODE, "claude-code", "claude")


@pytest.fixture(scope="session")
def qwen_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, QWEN_CODE, "qwen-code", "qwen")


@pytest.fixture(scope="session")
def opencode_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, OPENCODE, "opencode", "opencode")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "demo"-size tiny model (8192 positions, a 4096-token vocabulary: a harness's
    prompt takes about half the tokens it takes with the "test" model's), cached as
    :func:`tiny_model_dir` is."""
    env = os.environ.get("QWENGYRE_CACHE")
    cache_dir = Path(env) if env else tmp_path_factory.getbasetemp().parent / "qwengyre-models"
    return cached_tiny_model("demo", cache_dir=cache_dir)


@pytest.fixture
def two_ray_nodes() -> Iterator[None]:
    """A Ray cluster of two 1-CPU nodes on this machine (each its own raylet and object
    store), this process connected to it."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    cluster = Cluster(
        initialize_head=True, connect=True, head_node_args={**node, "include_dashboard": False}
    )
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()
