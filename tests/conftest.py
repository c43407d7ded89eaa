"""Shared pytest fixtures."""

from __future__ import annotations

import json
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
    return cached_tiny_model("test", cache_dir=_model_cache(tmp_path_factory))


@pytest.fixture(scope="session")
def coder_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test"-size tiny model with the Qwen3-Coder-style chat template (XML tool
    calls, ``<think>`` reasoning), cached as :func:`tiny_model_dir`."""
    return cached_tiny_model(
        "test", cache_dir=_model_cache(tmp_path_factory), template="qwen3-coder"
    )


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test"-size tiny model whose generation prompt opens the reasoning
    (``<|im_start|>assistant\n<think>\n``, as Qwen3 thinking models; hermes tool calls),
    cached as :func:`tiny_model_dir`."""
    return cached_tiny_model(
        "test", cache_dir=_model_cache(tmp_path_factory), template="qwen3-thinking"
    )


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test"-size tiny Qwen3-MoE (4 experts a layer, 2 per token; the dense model's
    tokenizer and template), cached as :func:`tiny_model_dir`."""
    return cached_tiny_model("test", cache_dir=_model_cache(tmp_path_factory), moe=True)


def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("QWENGYRE_CACHE")
    return Path(env) if env else tmp_path_factory.getbasetemp().parent / "qwengyre-models"


CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
"""The real Claude Code CLI the harness tests install with npm (pinned)."""
QWEN_CODE = "@qwen-code/qwen-code@0.24.4"
"""The real Qwen Code CLI the harness tests install with npm (pinned)."""
CODEX = "@openai/codex@0.171.0"
"""The real Codex CLI (OpenAI Responses API only) the harness tests install (pinned)."""
OPENCODE = "opencode-ai@1.18.33"
"""The real OpenCode CLI the harness tests install with npm (pinned; its platform binary
comes as an optional dependency)."""


def proxy_bodies(monkeypatch: pytest.MonkeyPatch, suffix: str) -> list[tuple[dict, dict]]:
    """From now on, every request body the proxy reads on a path ending ``suffix``: (its
    headers, lower-cased, and its JSON), in order."""
    from qwengyre.proxy import server

    seen: list[tuple[dict, dict]] = []
    read = server.read_body

    async def spy(http, max_bytes):  # type: ignore[no-untyped-def]
        body = await read(http, max_bytes)
        if http.path.endswith(suffix):
            seen.append(({k.lower(): v for k, v in http.headers.items()}, json.loads(body)))
        return body

    monkeypatch.setattr(server, "read_body", spy)
    return seen


def npm_bin(tmp_path_factory: pytest.TempPathFactory, package: str, name: str) -> Path:
    """The ``name`` command of the npm ``package`` (pinned), installed once into a cache
    folder of its own (under ``$QWENGYRE_NPM_CACHE``, else next to pytest's base temp
    dir); skips, saying why, when node/npm are missing or the install fails (no
    network)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"node and npm are needed to run the real {package}")
    prefix = Path(os.environ.get("QWENGYRE_NPM_CACHE", tmp_path_factory.getbasetemp().parent))
    prefix = prefix / package.replace("/", "+")  # a new pin installs anew
    binary = prefix / "node_modules" / ".bin" / name
    if not binary.exists():
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), package],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm could not install {package}: {done.stderr.strip()[-300:]}")
    return binary


@pytest.fixture(scope="session")
def claude_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, CLAUDE_CODE, "claude")


@pytest.fixture(scope="session")
def codex_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, CODEX, "codex")


@pytest.fixture(scope="session")
def qwen_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, QWEN_CODE, "qwen")


@pytest.fixture(scope="session")
def opencode_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_bin(tmp_path_factory, OPENCODE, "opencode")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "demo"-size tiny model (8192 positions, a 4096-token vocabulary: a harness's
    prompt takes about half the tokens it takes with the "test" model's), cached as
    :func:`tiny_model_dir` is."""
    return cached_tiny_model("demo", cache_dir=_model_cache(tmp_path_factory))


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
