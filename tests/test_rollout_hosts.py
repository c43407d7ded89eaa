"""The pool of harness hosts: it spreads executions by free capacity, never overfills a
host, waits when all are full, sends a cancel to the host that runs the execution, frees
the slot of a host that raised, and asks every host to check the sandbox and to stop
what a killed run left. What each host does is the harness host contract's
(test_rollout_harness_host_contract.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwengyre.rollout.execution import Budgets, ExecutionResult
from qwengyre.rollout.harness import PGID_FILE, HarnessSpec
from qwengyre.rollout.hosts import ExecutionRequest, HostPool, LocalHarnessHost
from qwengyre.rollout.sandbox import Bubblewrap, NoSandbox, SandboxUnavailable
from qwengyre.rollout.tasks import CommandEvaluator, Task
from qwengyre.types import Outcome

SCORE = "import json; print(json.dumps({'score': 1.0, 'valid': True}))"
TASK = Task(
    id="t", instructions="go", evaluator=CommandEvaluator(command=[sys.executable, "-c", SCORE])
)


def request(execution_id: str, *command: str) -> ExecutionRequest:
    spec = HarnessSpec(command=command or ("true",), deadline_s=20)
    return ExecutionRequest(
        task=TASK,
        harness=spec,
        budgets=Budgets(20, 30),
        execution_id=execution_id,
        base_url="http://127.0.0.1:9",
        api_key="k",
    )


def result(execution_id: str, outcome: Outcome) -> ExecutionResult:
    return ExecutionResult(
        execution_id=execution_id,
        task_id="t",
        outcome=outcome,
        reward=None,
        started_s=0.0,
        ended_s=0.0,
        harness=None,
    )


class FakeHost:
    """A host whose executions end when the test says so."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.closed = False
        self._ends: dict[str, asyncio.Future[ExecutionResult]] = {}

    async def run(self, request: ExecutionRequest) -> ExecutionResult:
        self.started.append(request.execution_id)
        end = self._ends[request.execution_id] = asyncio.get_running_loop().create_future()
        return await end

    def finish(self, execution_id: str, outcome: Outcome = Outcome.COMPLETED) -> None:
        self._ends[execution_id].set_result(result(execution_id, outcome))

    def fail(self, execution_id: str) -> None:
        self._ends[execution_id].set_exception(RuntimeError(f"{self.name} broke"))

    async def cancel(self, execution_id: str) -> None:
        self.cancelled.append(execution_id)
        self.finish(execution_id, Outcome.CANCELLED)

    async def close(self, *, keep_harnesses: bool = False) -> None:
        self.closed = True


async def settle() -> None:
    """Let every ready task run until it waits again."""
    for _ in range(10):
        await asyncio.sleep(0)


def start(pool: HostPool, *ids: str) -> dict[str, asyncio.Task[ExecutionResult]]:
    return {i: asyncio.ensure_future(pool.run(request(i))) for i in ids}


def test_the_pool_fills_the_most_free_host_first_and_waits_when_all_are_full() -> None:
    async def scenario() -> None:
        a, b, c = FakeHost("a", 1), FakeHost("b", 2), FakeHost("c", 3)
        pool = HostPool([a, b, c])
        assert pool.capacity == 6
        runs = start(pool, *(f"e{i}" for i in range(7)))
        await settle()
        # Most free slots first, then the fewest running: c(3) b(2, none running) c a b c.
        assert (a.started, b.started, c.started) == (["e3"], ["e1", "e4"], ["e0", "e2", "e5"])
        assert pool.running() == {"a": 1, "b": 2, "c": 3}  # e6 waits: every host is full
        b.finish("e4")
        await settle()
        assert b.started == ["e1", "e4", "e6"] and pool.running() == {"a": 1, "b": 2, "c": 3}
        assert (await runs["e4"]).outcome is Outcome.COMPLETED

    asyncio.run(scenario())


def test_a_cancel_goes_to_the_host_that_runs_it_and_a_waiting_one_never_starts() -> None:
    async def scenario() -> None:
        a, b = FakeHost("a", 1), FakeHost("b", 1)
        pool = HostPool([a, b])
        runs = start(pool, "e0", "e1", "e2")
        await settle()
        await pool.cancel("e1")
        assert (a.cancelled, b.cancelled) == ([], ["e1"])
        assert (await runs["e1"]).outcome is Outcome.CANCELLED
        await settle()
        assert b.started == ["e1", "e2"]  # the freed slot went to the waiting one
        runs |= start(pool, "e3")  # waits: both hosts are full
        await settle()
        await pool.cancel("e3")
        early = await runs["e3"]
        assert early.outcome is Outcome.CANCELLED and early.host == "" and early.reward is None
        await pool.cancel("e4")  # before its run is even asked for
        assert (await pool.run(request("e4"))).outcome is Outcome.CANCELLED
        assert "e3" not in a.started + b.started and "e4" not in a.started + b.started
        assert pool.running() == {"a": 1, "b": 1}

    asyncio.run(scenario())


def test_a_host_whose_run_raises_frees_its_slot() -> None:
    async def scenario() -> None:
        a = FakeHost("a", 1)
        pool = HostPool([a])
        runs = start(pool, "e0", "e1")
        await settle()
        assert a.started == ["e0"]
        a.fail("e0")
        with pytest.raises(RuntimeError, match="a broke"):
            await runs["e0"]
        await settle()
        assert a.started == ["e0", "e1"] and pool.running() == {"a": 1}
        a.finish("e1")
        assert (await runs["e1"]).outcome is Outcome.COMPLETED and pool.running() == {"a": 0}

    asyncio.run(scenario())


def test_closing_the_pool_closes_every_host_and_starts_nothing_more() -> None:
    async def scenario() -> None:
        a, b = FakeHost("a", 1), FakeHost("b", 1)
        pool = HostPool([a, b])
        runs = start(pool, "e0", "e1", "e2")
        await settle()
        await pool.close()
        assert a.closed and b.closed
        assert (await runs["e2"]).outcome is Outcome.CANCELLED
        assert (await pool.run(request("e3"))).outcome is Outcome.CANCELLED
        assert a.started + b.started == ["e0", "e1"]

    asyncio.run(scenario())


def test_a_pool_needs_hosts_of_distinct_names() -> None:
    with pytest.raises(ValueError, match="one or more hosts"):
        HostPool([])
    with pytest.raises(ValueError, match=r"distinct names, got \['a', 'a'\]"):
        HostPool([FakeHost("a", 1), FakeHost("a", 2)])
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        LocalHarnessHost(Path("."), capacity=0)


def gone(pid: int) -> bool:
    """The process is no more (a harness is reaped before its execution returns)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def orphan(root: Path, execution_id: str, runs_as: str | None = None) -> subprocess.Popen[bytes]:
    """A harness a killed run left: its own session, its group noted in the execution's
    logs under ``root``, carrying ``runs_as`` (default: that execution) as its id."""
    marker = f"QWENGYRE_EXECUTION_ID={runs_as or execution_id}"
    env = {**os.environ, "QWENGYRE_EXECUTION_ID": runs_as or execution_id}
    proc = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    environ = Path(f"/proc/{proc.pid}/environ")
    deadline = time.monotonic() + 10
    while marker.encode() not in environ.read_bytes():  # until it has exec'd
        assert time.monotonic() < deadline, "the orphan never started"
        time.sleep(0.01)
    logs = root / "logs" / execution_id
    logs.mkdir(parents=True)
    (logs / PGID_FILE).write_text(f"{proc.pid}\n")
    return proc


def test_the_pool_checks_the_sandbox_on_every_host(tmp_path: Path) -> None:
    pool = HostPool([LocalHarnessHost(tmp_path / d, capacity=1, name=d) for d in "ab"])
    asyncio.run(pool.check_sandbox(NoSandbox()))
    with pytest.raises(SandboxUnavailable, match="no 'no-such-bwrap' on PATH"):
        asyncio.run(pool.check_sandbox(Bubblewrap(binary="no-such-bwrap")))


def test_the_pool_stops_the_harnesses_a_killed_run_left_under_each_host(tmp_path: Path) -> None:
    left = [orphan(tmp_path / "a", "ex_1"), orphan(tmp_path / "a", "ex_2")]
    left.append(orphan(tmp_path / "c", "ex_3"))
    pool = HostPool([LocalHarnessHost(tmp_path / d, capacity=1, name=d) for d in "abc"])
    assert asyncio.run(pool.stop_orphans()) == {"a": 2, "b": 0, "c": 1}
    assert [process.wait(10) for process in left] == [-9] * 3


def test_a_resumed_host_adopts_the_harness_a_dead_one_left_and_stops_the_others(
    tmp_path: Path,
) -> None:
    """Harnesses under the directory's daemon outlive their host (its controller died
    without closing it): a new host on the directory lists them, adopts one (it is not
    started again, and is evaluated when it ends) and stops the one it does not keep."""
    wait_for_go = "echo $$ >> pid; while [ ! -e go ]; do sleep 0.05; done; echo 1 > a.txt"

    async def go() -> tuple[ExecutionResult, list[str], int]:
        dead = LocalHarnessHost(tmp_path, capacity=2, daemon=True)
        first = dead.start(request("ex_a", "sh", "-c", wait_for_go))
        other = dead.start(request("ex_b", "sh", "-c", "echo $$ > pid; exec sleep 60"))
        pid_file = tmp_path / "workspaces" / "ex_b" / "pid"
        while not pid_file.exists() or not (tmp_path / "workspaces" / "ex_a" / "pid").exists():
            await asyncio.sleep(0.02)
        for task in (first, other):
            task.cancel()  # the controller's side is gone; its harnesses are not
        resumed = LocalHarnessHost(tmp_path, capacity=2, daemon=True)
        try:
            survivors = sorted(await resumed.survivors())
            assert await resumed.stop_orphans(keep={"ex_a"}) == 1
            adopted = asyncio.ensure_future(resumed.adopt(request("ex_a", "false")))
            (tmp_path / "workspaces" / "ex_a" / "go").touch()
            return await adopted, survivors, int(pid_file.read_text())
        finally:
            await resumed.close()

    result, survivors, stopped = asyncio.run(go())
    assert survivors == ["ex_a", "ex_b"]
    assert result.outcome is Outcome.COMPLETED and result.reward == 1.0
    assert len((tmp_path / "workspaces" / "ex_a" / "pid").read_text().split()) == 1
    assert gone(stopped)
