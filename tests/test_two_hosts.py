"""`qwengyre train` over two hosts with their own addresses.

The test makes the hosts itself: two network namespaces joined by a veth pair (host A
10.213.N.1, host B 10.213.N.2, each with its own loopback and a default route through
the other), a Ray head in A and a Ray worker in B, two CPUs each. The run's driver and
proxy live in A; cell 1's two ranks (its engine and trainer shards) fit only on B, and B
has its own harness host. So the proxy reaches an engine at B's address, a harness on B
reaches the proxy at A's, and the steps they feed train across both. Creating
namespaces needs root (CAP_NET_ADMIN): where that is refused the test is skipped,
saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.test_runtime_train import overrides, served_calls

from qwengyre.records.metrics import read_metrics

pytestmark = pytest.mark.slow

IFNAME = "qg0"
"""The veth end's name in both namespaces: gloo picks it by name (GLOO_SOCKET_IFNAME),
as a real cluster names its data interface."""


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.213.{int(tag, 16) % 250 + 1}"
    a, b = Host(f"qga{tag}", f"{subnet}.1"), Host(f"qgb{tag}", f"{subnet}.2")
    try:
        _ip("netns", "add", a.namespace)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create a network namespace here: {error.stderr.strip()}")
    try:
        _ip("netns", "add", b.namespace)
        _ip("link", "add", f"qa{tag}", "type", "veth", "peer", "name", f"qb{tag}")
        for host, end, peer in ((a, f"qa{tag}", b), (b, f"qb{tag}", a)):
            _ip("link", "set", end, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", end, "name", IFNAME)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", IFNAME)
            _ip("-n", host.namespace, "link", "set", IFNAME, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "route", "add", "default", "via", peer.address)
        yield a, b
    finally:
        for host in (a, b):
            pids = subprocess.run(
                ["ip", "netns", "pids", host.namespace], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:  # Ray's daemons, and anything they left
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)


def _ray(host: Host, env: dict[str, str], *argv: str) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    done = subprocess.run(
        host.command(ray, "start", "--disable-usage-stats", *argv),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_cells_engines_and_harnesses_on_two_hosts_train_together(
    two_hosts: tuple[Host, Host], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two cells of two FSDP2 ranks on two 2-CPU hosts: cell 0 (the core) on A, cell 1
    on B, so gradients and weight shards cross between the hosts' addresses, B's engine
    reads the core's boards from Ray's object store, the proxy on A routes to B's
    engine, and harnesses run on both hosts (one harness host each)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    a, b = two_hosts
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": IFNAME}
    head = f"{a.address}:6379"
    cpus = ("--num-cpus", "2", "--object-store-memory", str(100 * 2**20))
    temp = tempfile.mkdtemp(prefix="qg-ray-", dir="/tmp")  # unix sockets: < 108 bytes
    _ray(a, env, "--head", "--node-ip-address", a.address, "--port", "6379",
         "--include-dashboard", "false", "--temp-dir", temp, *cpus)  # fmt: skip
    _ray(b, env, "--address", head, "--node-ip-address", b.address, *cpus)
    run_dir = tmp_path / "run"
    train = a.command(
        sys.executable, "-m", "qwengyre", "train", "--quiet", "--run-dir", str(run_dir),
        *overrides(tmp_path, tiny_model_dir),
        "run.steps=2", "run.placement=ray", "cells.count=2", "cells.devices_per_cell=2",
        "engine.host=0.0.0.0", "proxy.host=0.0.0.0", "harness.hosts=ray",
        "scheduler.target_staleness=null", "scheduler.mu=1", "scheduler.phi=0",
    )  # fmt: skip
    try:
        done = subprocess.run(
            train, env={**env, "RAY_ADDRESS": head}, capture_output=True, text=True, timeout=480
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    trained = [g.group_id for g in metrics.groups]
    assert len(trained) == 2 * 2 and len(set(trained)) == len(trained)
    # The proxy on A routed calls to cell 1's engine, which could only be on B, and the
    # engines sampled with the weights published after step 1 (read shard by shard).
    calls = served_calls(run_dir)
    assert "cell-1" in {engine for engine, _ in calls}
    assert {version for _, version in calls} >= {1}
    traces = [json.loads(t) for t in (run_dir / "traces.jsonl").read_text().splitlines()]
    ran = Counter(t["host"].partition("/")[0] for t in traces if t["outcome"] == "completed")
    assert set(ran) == {a.address, b.address}, ran  # harnesses ran on both hosts
