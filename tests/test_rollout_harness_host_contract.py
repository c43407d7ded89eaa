"""The harness host interface's contract (:class:`~qwengyre.rollout.hosts.HarnessHost`),
asserted of every implementation, each a fresh host of two slots under a test's
directory:

- ``local``: :class:`~qwengyre.rollout.hosts.LocalHarnessHost`, in this process, its
  harnesses under the directory's harness daemon (as ``train`` runs it);
- ``ray``: :class:`~qwengyre.cluster.ray_harness.RayHarnessHost`, an actor on the one
  node of a local Ray (started once for the module).

What is particular to one kind (where a Ray host's harnesses run, its assessments and
model-call counts through the proxy) stays in its own tests; how the pool spreads
executions over hosts is in test_rollout_hosts.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from tests.contracts import implementations
from tests.test_rollout_hosts import gone, orphan, request

from qwengyre.rollout.hosts import HarnessHost, LocalHarnessHost
from qwengyre.rollout.sandbox import Bubblewrap, NoSandbox, SandboxUnavailable
from qwengyre.types import Outcome

CAPACITY = 2
SLEEPER = ("sh", "-c", "echo $$ > pid; exec sleep 60")
"""A harness that notes its pid in its workspace and runs until it is killed."""


class NoProxy:
    """The proxy as a host sees it, for executions that never ask it anything."""

    def register_assessor(self, execution_id: str, assessor: Any) -> None:
        pass

    def unregister_assessor(self, execution_id: str) -> None:
        pass

    async def tree(self, execution_id: str) -> Any:
        raise AssertionError(f"execution {execution_id} asked the proxy for its calls")


@pytest.fixture(scope="module")
def one_ray_node() -> Iterator[None]:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20)
    try:
        yield
    finally:
        ray.shutdown()


@asynccontextmanager
async def local(root: Path, request: pytest.FixtureRequest) -> AsyncIterator[HarnessHost]:
    yield LocalHarnessHost(root, capacity=CAPACITY, name="here", daemon=True)


@asynccontextmanager
async def on_ray(root: Path, request: pytest.FixtureRequest) -> AsyncIterator[HarnessHost]:
    request.getfixturevalue("one_ray_node")
    from qwengyre.cluster.ray_harness import RayHarnessHost, harness_nodes

    (node,) = harness_nodes()
    yield RayHarnessHost(
        node,
        capacity=CAPACITY,
        harness_dir=root,
        hub=NoProxy(),
        proxy_url="http://127.0.0.1:9",
        admin_token="unused",
    )


HOSTS: dict[str, Callable[[Path, pytest.FixtureRequest], AbstractAsyncContextManager[HarnessHost]]]
HOSTS = {"local": local, "ray": on_ray}

Drive = Callable[[Callable[[HarnessHost], Awaitable[Any]]], Any]


@pytest.fixture(params=implementations(HOSTS))
def drive(request: pytest.FixtureRequest, tmp_path: Path) -> Drive:
    """Runs a test's coroutine with a host of the implementation the test is
    parametrised with (under ``tmp_path``), closed afterwards; returns what it returns."""

    def run(test: Callable[[HarnessHost], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            async with HOSTS[request.param](tmp_path, request) as host:
                try:
                    return await asyncio.wait_for(test(host), 120)
                finally:
                    await host.close()

        return asyncio.run(main())

    return run


async def pid_of(root: Path, execution_id: str) -> int:
    """The pid a :data:`SLEEPER` harness noted, once it has."""
    path = root / "workspaces" / execution_id / "pid"
    while not path.exists() or not path.read_text().strip():
        await asyncio.sleep(0.02)
    return int(path.read_text())


def test_a_host_runs_an_execution_to_its_outcome(drive: Drive, tmp_path: Path) -> None:
    async def t(host: HarnessHost) -> Any:
        return host.name, await host.run(request("ex_done", "sh", "-c", "echo 1 > a.txt"))

    name, done = drive(t)
    assert done.outcome is Outcome.COMPLETED and done.reward == 1.0 and done.host == name
    assert (tmp_path / "workspaces" / "ex_done" / "a.txt").exists()  # under its directory


def test_a_host_runs_as_many_executions_at_once_as_its_capacity(
    drive: Drive, tmp_path: Path
) -> None:
    async def t(host: HarnessHost) -> Any:
        assert host.capacity == CAPACITY
        ids = [f"ex_{i}" for i in range(host.capacity)]
        runs = [asyncio.ensure_future(host.run(request(i, *SLEEPER))) for i in ids]
        pids = [await pid_of(tmp_path, i) for i in ids]  # every one runs, none has ended
        assert not any(run.done() for run in runs)
        for i in ids:
            await host.cancel(i)
        return await asyncio.gather(*runs), pids

    results, pids = drive(t)
    assert [r.outcome for r in results] == [Outcome.CANCELLED] * CAPACITY
    assert all(gone(pid) for pid in pids)


def test_a_cancel_kills_the_harness_of_that_execution_only(drive: Drive, tmp_path: Path) -> None:
    async def t(host: HarnessHost) -> Any:
        cancelled = asyncio.ensure_future(host.run(request("ex_c", *SLEEPER)))
        spared = asyncio.ensure_future(host.run(request("ex_s", *SLEEPER)))
        pids = [await pid_of(tmp_path, "ex_c"), await pid_of(tmp_path, "ex_s")]
        await host.cancel("ex_unknown")  # not running here: nothing to stop
        await host.cancel("ex_c")
        result = await cancelled
        assert not gone(pids[1]) and not spared.done()
        await host.cancel("ex_s")
        await spared
        return host.name, result, pids

    name, cancelled, (pid, _) = drive(t)
    assert cancelled.outcome is Outcome.CANCELLED and cancelled.host == name
    assert gone(pid)


def test_closing_a_host_stops_the_executions_running_there(drive: Drive, tmp_path: Path) -> None:
    async def t(host: HarnessHost) -> Any:
        running = asyncio.ensure_future(host.run(request("ex_k", *SLEEPER)))
        pid = await pid_of(tmp_path, "ex_k")
        await host.close()
        return await asyncio.gather(running, return_exceptions=True), pid

    (outcome,), pid = drive(t)
    assert gone(pid)
    # the execution ends with the host: cancelled, or failed with the host's death
    assert isinstance(outcome, Exception) or outcome.outcome is Outcome.CANCELLED


@pytest.fixture(params=implementations(HOSTS))
def new_host(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], AbstractAsyncContextManager[HarnessHost]]:
    """Makes hosts of one implementation under ``tmp_path``, as a restarted run does."""
    return lambda: HOSTS[request.param](tmp_path, request)


def test_a_host_closed_keeping_its_harnesses_leaves_them_to_the_next_run(
    new_host: Callable[[], AbstractAsyncContextManager[HarnessHost]], tmp_path: Path
) -> None:
    """A run that restarts itself (its core died) closes its hosts with
    ``keep_harnesses``: the harness goes on under its daemon, and the restarted run's
    host lists it and re-adopts it."""
    script = "echo $$ > pid; while [ ! -e go ]; do sleep 0.05; done"

    async def main() -> Any:
        async with new_host() as first:
            watched = asyncio.ensure_future(first.run(request("ex_kept", "sh", "-c", script)))
            pid = await pid_of(tmp_path, "ex_kept")
            await first.close(keep_harnesses=True)
            await asyncio.gather(watched, return_exceptions=True)
        assert not gone(pid)
        async with new_host() as second:
            try:
                assert await second.survivors() == ["ex_kept"]
                adopted = asyncio.ensure_future(second.adopt(request("ex_kept", "unused")))
                (tmp_path / "workspaces" / "ex_kept" / "go").touch()
                return await asyncio.wait_for(adopted, 60), pid
            finally:
                await second.close()

    result, pid = asyncio.run(main())
    assert result.outcome is Outcome.COMPLETED and gone(pid)


def test_a_host_stops_the_harnesses_a_killed_run_left_under_its_directory(
    drive: Drive, tmp_path: Path
) -> None:
    left = orphan(tmp_path, "ex_1")
    recycled = orphan(tmp_path, "ex_2", runs_as="ex_other")  # its pid reused since
    elsewhere = orphan(tmp_path / "other-host", "ex_3")
    try:
        assert drive(lambda host: host.stop_orphans()) == 1
        assert left.wait(10) == -9
        assert recycled.poll() is None and elsewhere.poll() is None
    finally:
        for process in (recycled, elsewhere):
            process.kill()
            process.wait()


def test_a_host_checks_a_sandbox_on_its_machine(drive: Drive) -> None:
    async def t(host: HarnessHost) -> None:
        await host.check_sandbox(NoSandbox())
        with pytest.raises(SandboxUnavailable, match="no 'no-such-bwrap' on PATH"):
            await host.check_sandbox(Bubblewrap(binary="no-such-bwrap"))

    drive(t)
