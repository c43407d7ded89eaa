"""A cell's SGLang server (``engine.backend=sglang``) against the fake launcher in
tests/fake_sglang (qwengyre's engine server behind SGLang's API and flags, generating
from the tiny model): its flags and key (in a private config file, not on its command
line), the boards' weights published through disk, its end; the fake's ``--config``;
and the tensor parallel commands of both server hosts. Role switches and revival are
the rollout host contract's (test_cluster_rollout_host_contract.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import yaml
from tests.core_boards import core_boards, perturbed
from tests.fake_sglang.sglang.launch_server import parser, with_config

from qwengyre.apps.serve import close_engine, model_engine
from qwengyre.cluster.engine_host import Endpoint, rollout_host
from qwengyre.cluster.server_host import ServerHost
from qwengyre.cluster.weights import BoardShards, SharedWeights
from qwengyre.config import EngineConfig
from qwengyre.engines.base import (
    GenerateRequest,
    GenerateResult,
    WeightsInMemory,
)
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.engines.factory import server_backend
from qwengyre.engines.http_client import HTTPEngineClient
from qwengyre.engines.sglang import SGLangBackend, SGLangEngine
from qwengyre.types import SamplingParams

FAKE = Path(__file__).parent / "fake_sglang"
GREEDY = GenerateRequest(
    "r", (5, 6, 7, 8), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
)


@dataclass
class Cell:
    """A host serving the fake, the boards it loads from, and what the fake recorded."""

    host: ServerHost[SGLangEngine]
    endpoint: Endpoint
    board: SharedWeights
    boards: BoardShards
    record: Path


def use_fake(env: pytest.MonkeyPatch, record: Path) -> Path:
    """``python -m sglang.launch_server`` runs the fake, which records into ``record``."""
    env.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    env.delenv("QWENGYRE_SGLANG_PYTHON", raising=False)
    env.setenv("QWENGYRE_FAKE_SGLANG_RECORD", str(record))
    return record


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    return use_fake(monkeypatch, tmp_path / "record.json")


@pytest.fixture(scope="module")
def cell(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cell]:
    """One host for the module's tests: each starts from the version the last left."""
    with pytest.MonkeyPatch.context() as env, core_boards(tiny_model_dir) as (board, boards):
        record = use_fake(env, tmp_path_factory.mktemp("sglang") / "record.json")
        host = rollout_host(
            "sglang",
            str(tiny_model_dir),
            name="cell-1",
            capacity=4,
            device="cpu",
            max_context=256,
            seed=0,
            host="127.0.0.1",
        )
        assert isinstance(host, ServerHost) and isinstance(host.backend, SGLangBackend)
        try:
            yield Cell(host, host.start(), board, boards, record)
        finally:
            host.close()


def generate(endpoint: Endpoint) -> GenerateResult:
    """Greedy tokens from the proxy's client of ``endpoint``."""

    async def main() -> GenerateResult:
        engine = endpoint.client("proxy", 1, version=-1)
        assert isinstance(engine, HTTPEngineClient)
        async with engine:
            return await engine.generate(GREEDY)

    return asyncio.run(main())


def launched_argv(host: ServerHost[SGLangEngine]) -> list[str]:
    """The server's command line as any local user sees it (``ps``)."""
    assert host._process is not None
    return Path(f"/proc/{host._process.pid}/cmdline").read_text().split("\0")[:-1]


def test_the_host_launches_sglang_with_its_flags_and_key(cell: Cell, tiny_model_dir: Path) -> None:
    recorded = json.loads(cell.record.read_text())
    argv = launched_argv(cell.host)
    key = cell.endpoint.api_key
    assert key.isalnum()  # no "-" first, which SGLang would read as a flag
    assert not any(key in arg for arg in argv)
    config = Path(argv[argv.index("--config") + 1])
    assert yaml.safe_load(config.read_text()) == {"api-key": key}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    flags = {
        "--model-path": str(tiny_model_dir),
        "--host": "127.0.0.1",
        "--port": cell.endpoint.url.rsplit(":", 1)[1],
        "--tp-size": "1",
        "--context-length": "256",
    }
    assert {flag: argv[argv.index(flag) + 1] for flag in flags} == flags
    assert "--enable-memory-saver" not in argv  # CPU: nothing to free
    assert "--weight-version" not in argv  # nothing of the run's yet
    assert recorded["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert cell.endpoint.api == "sglang"

    result = generate(cell.endpoint)
    assert len(result.output_ids) == len(result.logprobs) == 6
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.versions == (cell.host.version,) * 6  # -1 until the boards' are loaded

    async def anonymous() -> int:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{cell.endpoint.url}/generate", json={"input_ids": [5]}) as answer,
        ):
            return answer.status

    assert asyncio.run(anonymous()) == 401


def test_load_newest_publishes_the_boards_weights(cell: Cell, tiny_model_dir: Path) -> None:
    before = generate(cell.endpoint)
    version = max(cell.host.version, 0) + 1
    weights = perturbed(tiny_model_dir, seed=version)
    cell.board.write(weights.items(), version)  # the core published a version
    assert cell.host.load_newest(cell.boards) == version
    after = generate(cell.endpoint)
    assert after.versions == (version,) * 6
    assert after.logprobs != before.logprobs

    reference = EmbeddedEngine(tiny_model_dir, name="reference", capacity=1)
    try:
        asyncio.run(reference.update_weights(WeightsInMemory(weights), version))
        expected = asyncio.run(reference.generate(GREEDY))
    finally:
        reference.close()
    assert after.output_ids == expected.output_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-4)

    cell.board.write(perturbed(tiny_model_dir, seed=version + 1).items(), version + 1)
    assert cell.host.load_newest(cell.boards) == version + 1
    assert cell.host.load_newest(cell.boards) == version + 1  # nothing newer: nothing loaded
    newest_only = ["server.yaml", f"v{version + 1}"]
    assert sorted(p.name for p in cell.host._work.iterdir()) == newest_only


def test_a_host_serves_its_model_as_the_version_given_and_closes_for_good(
    tiny_model_dir: Path, fake_sglang: Path
) -> None:
    host = ServerHost(
        SGLangBackend(),
        str(tiny_model_dir),
        name="rollout",
        device="cpu",
        gpus=(),
        max_context=None,
        host="127.0.0.1",
        version=7,
    )
    try:
        endpoint = host.start()
        argv = json.loads(fake_sglang.read_text())["argv"]
        config = Path(argv[argv.index("--config") + 1])
        assert argv[argv.index("--weight-version") + 1] == "7"
        assert "--context-length" not in argv
        assert generate(endpoint).versions == (7,) * 6
        assert host._process is not None
        group, work = host._process.pid, host._work
    finally:
        host.close()
    with pytest.raises(ProcessLookupError):  # no process of the server's group is left
        os.killpg(group, 0)
    assert not config.exists() and not work.exists()


def test_proxy_serve_and_rollout_launch_the_backend_for_their_block(
    tiny_model_dir: Path, fake_sglang: Path
) -> None:
    """``engine.backend=sglang`` in ``proxy serve`` / ``rollout``: the proxy's engine is a
    server launched for the run, serving the model as version 0, stopped at its end."""
    settings = EngineConfig(backend="sglang")
    with model_engine(
        tiny_model_dir, settings, device="cpu", capacity=4, max_context=None
    ) as engine:
        assert isinstance(engine, SGLangEngine) and engine.name == "sglang"

        async def call() -> GenerateResult:
            try:
                return await engine.generate(GREEDY)
            finally:
                await close_engine(engine)

        assert asyncio.run(call()).versions == (0,) * 6
        pid = json.loads(fake_sglang.read_text())["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_fake_reads_a_config_file_as_sglang_does(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("api-key: k3y\nenable-memory-saver: true\nport: 1\n")
    args = parser().parse_args(with_config(["--model-path", "/m", "--config", str(config)]))
    assert (args.api_key, args.enable_memory_saver, args.port) == ("k3y", True, 1)
    args = parser().parse_args(with_config(["--config", str(config), "--model", "/m", "--port=2"]))
    assert args.port == 2  # the command line wins


@pytest.mark.parametrize(
    ("name", "text", "tail"),
    [
        ("c.yaml", "api-key: k3y\n", ["--config", "c.yaml"]),  # one file only
        ("c.json", "api-key: k3y\n", []),  # YAML (only newer SGLang takes JSON)
        ("c.yaml", "api_key: k3y\n", []),  # not a flag's name
        ("c.yaml", "api-key: -k3y\n", []),  # read as a flag
        ("c.yaml", "[api-key, k3y]\n", []),  # not a mapping
    ],
)
def test_the_fake_refuses_what_an_sglang_with_config_refuses(
    tmp_path: Path, name: str, text: str, tail: list[str]
) -> None:
    (tmp_path / name).write_text(text)
    argv = ["--model-path", "/m", "--api-key", "k", "--config", str(tmp_path / name), *tail]
    with pytest.raises(SystemExit) as refused:
        parser().parse_args(with_config(argv))
    assert refused.value.code == 2


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_server_runs_tensor_parallel_over_the_cells_gpus(backend: str) -> None:
    tp_flag = {"sglang": "--tp-size", "vllm": "--tensor-parallel-size"}[backend]
    free_flag = {"sglang": "--enable-memory-saver", "vllm": "--enable-sleep-mode"}[backend]
    hosts = [
        ServerHost(
            server_backend(backend),
            "/m",
            name="c",
            device=device,
            gpus=gpus,
            max_context=None,
            host="127.0.0.1",
            version=-1,
        )
        for device, gpus in [("cuda:0", ("2", "3")), ("cuda:1", ())]
    ]
    try:
        (pair, own) = (host.backend.spec(host.placement()) for host in hosts)
        argv = pair.command()
        assert argv[argv.index(tp_flag) + 1] == "2"
        assert free_flag in argv
        assert pair.env()["CUDA_VISIBLE_DEVICES"] == "2,3"
        argv = own.command()  # no ids given: the device's own index
        assert argv[argv.index(tp_flag) + 1] == "1"
        assert own.env()["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        for host in hosts:
            host.close()


def test_an_moe_host_reports_routed_experts_to_the_proxys_client(
    tiny_moe_model_dir: Path, fake_sglang: Path
) -> None:
    """engine.return_routed_experts: the server runs with SGLang's flag, the endpoint's
    client asks, and the rows are the embedded engine's own, by position (off: no flag,
    tests/test_engine_sglang.py; not asked: none, tests/test_engine_server.py)."""
    reference = EmbeddedEngine(tiny_moe_model_dir, name="reference", capacity=1)
    try:
        expected = asyncio.run(reference.generate(GREEDY))
    finally:
        reference.close()
    assert expected.routing is not None and expected.routing.shape == (4 + 6 - 1, 2, 2)
    host = rollout_host(
        "sglang",
        str(tiny_moe_model_dir),
        name="cell-moe",
        capacity=1,
        device="cpu",
        max_context=256,
        seed=0,
        host="127.0.0.1",
        routed_experts=True,
    )
    try:
        endpoint = host.start()
        argv = json.loads(fake_sglang.read_text())["argv"]
        result = generate(endpoint)
    finally:
        host.close()
    assert "--enable-return-routed-experts" in argv and endpoint.routed_experts == (2, 2)
    assert result.output_ids == expected.output_ids
    assert result.routing is not None and np.array_equal(result.routing, expected.routing)
