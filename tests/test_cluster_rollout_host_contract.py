"""The rollout host interface's contract (:class:`~qwengyre.cluster.engine_host.RolloutHost`),
asserted of every implementation, each one host for the module that the cases drive
in turn (a cell's life: publish, load, release, resume, crash, revive):

- ``embedded``: :class:`~qwengyre.cluster.engine_host.EngineHost`;
- ``sglang-fake``: :class:`~qwengyre.cluster.server_host.ServerHost` with SGLang,
  launching the fake SGLang server of tests/fake_sglang (qwengyre's engine server behind
  SGLang's flags);
- ``vllm``: :class:`~qwengyre.cluster.server_host.ServerHost` with vLLM, launching a real
  vLLM CPU server (skipped unless ``QWENGYRE_VLLM_PYTHON`` names a vLLM venv's python).

A case an implementation cannot meet is marked in its parametrisation with the reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.contracts import implementations
from tests.core_boards import core_boards, perturbed
from tests.test_cluster_sglang_host import generate, use_fake

from qwengyre.cluster.engine_host import Endpoint, RolloutHost, rollout_host
from qwengyre.cluster.server_host import ServerHost
from qwengyre.cluster.weights import BoardShards, SharedWeights
from qwengyre.engines.base import EngineAborted
from qwengyre.engines.http_client import HTTPEngineClient
from qwengyre.engines.vllm import vllm_available
from qwengyre.models import cached_tiny_model

FREED = {"embedded": "released", "sglang-fake": "asleep", "vllm": "stopped"}
"""What each host's release answers on the CPU (vLLM's sleep frees nothing there)."""


@dataclass
class Cell:
    """A started host, the boards it loads from, and how to crash its server."""

    name: str
    host: RolloutHost
    endpoint: Endpoint
    model: Path
    board: SharedWeights
    boards: BoardShards
    crash: Callable[[], None] | None  # None: it has no server process of its own

    def publish(self) -> int:
        """The core publishes a new version (one above the newest published); which."""
        version = max(self.board.version, 0) + 1
        self.board.write(perturbed(self.model, seed=version).items(), version)
        return version


def kill_server(host: ServerHost[Any]) -> Callable[[], None]:
    def crash() -> None:
        process = host._process
        assert process is not None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    return crash


def model_for(backend: str, tiny_model_dir: Path) -> Path:
    if backend != "vllm":
        return tiny_model_dir
    python = os.environ.get("QWENGYRE_VLLM_PYTHON")
    if not python or not vllm_available(python):
        pytest.skip("QWENGYRE_VLLM_PYTHON is not the python of a vLLM venv")
    # vLLM's CPU attention has no kernel for the test model's head size
    return cached_tiny_model("demo", cache_dir=tiny_model_dir.parent)


BACKENDS = ("embedded", "sglang-fake", "vllm")


def backends(**cannot: str) -> pytest.MarkDecorator:
    """Parametrise a case over the module's host of every implementation (see
    :func:`tests.contracts.implementations`)."""
    return pytest.mark.parametrize("cell", implementations(BACKENDS, **cannot), indirect=True)


@pytest.fixture(scope="module")
def cell(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cell]:
    backend = request.param.removesuffix("-fake")
    model = model_for(backend, tiny_model_dir)
    with pytest.MonkeyPatch.context() as env, core_boards(model) as (board, boards):
        if request.param == "sglang-fake":
            use_fake(env, tmp_path_factory.mktemp("sglang") / "record.json")
        host = rollout_host(
            backend,  # type: ignore[arg-type]
            str(model),
            name="cell-1",
            capacity=4,
            device="cpu",
            max_context=256,
            seed=0,
            host="127.0.0.1",
        )
        try:
            endpoint = host.start()
            crash = kill_server(host) if isinstance(host, ServerHost) else None
            yield Cell(request.param, host, endpoint, model, board, boards, crash)
        finally:
            host.close()


@backends()
def test_a_started_host_serves_at_its_endpoint(cell: Cell) -> None:
    result = generate(cell.endpoint)
    assert len(result.output_ids) == len(result.logprobs) == 6
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.versions == (-1,) * 6  # nothing of the run's until the boards' are loaded


@backends()
def test_load_newest_serves_the_boards_newest_weights(cell: Cell) -> None:
    before = generate(cell.endpoint)
    version = cell.publish()
    assert cell.host.load_newest(cell.boards) == version
    after = generate(cell.endpoint)
    assert after.versions == (version,) * 6 and after.logprobs != before.logprobs
    assert cell.host.load_newest(cell.boards) == version  # nothing newer: nothing loaded
    assert generate(cell.endpoint) == after


@backends()
def test_a_released_host_serves_nothing_and_resumes_with_the_newest(cell: Cell) -> None:
    assert cell.host.release() == FREED[cell.name]
    with pytest.raises((EngineAborted, OSError)):  # the proxy drained it before anyway
        generate(cell.endpoint)
    version = cell.publish()  # the core trained meanwhile
    assert cell.host.resume(cell.boards) == version
    assert generate(cell.endpoint).versions == (version,) * 6


def healthy(endpoint: Endpoint) -> bool:
    """The health check of the proxy's client of ``endpoint`` (it may raise)."""

    async def main() -> bool:
        engine = endpoint.client("proxy", 1, version=-1)
        assert isinstance(engine, HTTPEngineClient)
        async with engine:
            return await engine.health()

    return asyncio.run(main())


@backends()
def test_revive_leaves_a_serving_host_alone(cell: Cell) -> None:
    served = generate(cell.endpoint)
    assert healthy(cell.endpoint)
    assert not cell.host.revive(cell.boards)
    assert generate(cell.endpoint) == served


@backends(embedded="the engine lives in the host's process: it has no server to crash")
def test_a_crashed_server_is_revived_at_its_endpoint_with_the_newest(cell: Cell) -> None:
    assert cell.crash is not None
    cell.crash()
    with pytest.raises(OSError):
        generate(cell.endpoint)
    # The proxy's periodic check tells it from a server that answers unhealthy.
    with pytest.raises(ConnectionRefusedError):
        healthy(cell.endpoint)
    version = cell.publish()  # and the core published meanwhile
    # A publication that comes before the revival calls no dead server, and fails nothing.
    assert cell.host.load_newest(cell.boards) < version
    assert cell.host.revive(cell.boards)
    # the proxy's client of the same endpoint (address and key) is served again
    assert generate(cell.endpoint).versions == (version,) * 6
    assert healthy(cell.endpoint)
    assert not cell.host.revive(cell.boards)


@backends(embedded="the engine lives in the host's process: it has no server to crash")
def test_a_server_that_dies_during_a_load_fails_no_publication(cell: Cell) -> None:
    assert isinstance(cell.host, ServerHost) and cell.crash is not None
    served = cell.host.version
    process = cell.host._process
    assert process is not None
    os.killpg(process.pid, signal.SIGSTOP)  # the load's call hangs at a frozen server
    version = cell.publish()
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(cell.host.load_newest, cell.boards)
        time.sleep(1.0)  # most likely mid-call; the crash before the call answers alike
        cell.crash()
        assert load.result() == served < version  # the older version: revive it
    assert cell.host.revive(cell.boards)
    assert generate(cell.endpoint).versions == (version,) * 6


@backends(embedded="the engine lives in the host's process: it has no server to crash")
def test_a_server_that_dies_during_its_release_is_released_as_stopped(cell: Cell) -> None:
    """The cell moves to training while its server crashes (a crash the proxy had not
    seen yet): the release answers ``stopped``, not the dead server's refused connection,
    and the way back to rollout starts it again with the newest weights."""
    assert isinstance(cell.host, ServerHost) and cell.crash is not None
    process = cell.host._process
    assert process is not None
    os.killpg(process.pid, signal.SIGSTOP)  # the release's call hangs at a frozen server
    with ThreadPoolExecutor(1) as pool:
        release = pool.submit(cell.host.release)
        time.sleep(1.0)  # most likely mid-call
        cell.crash()
        assert release.result() == "stopped"
    version = cell.publish()
    assert cell.host.resume(cell.boards) == version
    assert generate(cell.endpoint).versions == (version,) * 6
