"""Harness hosts: where executions run, and the pool that spreads them.

A :class:`HarnessHost` starts, watches and kills the harness processes of the
executions it is given, with their workspaces on its machine, and evaluates them there
(:func:`~qwengyre.rollout.execution.run_execution`). Kinds:

- :class:`LocalHarnessHost`: in this process, workspaces and logs under one directory
  (``train``'s run directory): what ``qwengyre train`` does by default. With
  ``daemon=True`` (``train``) its harnesses run under that directory's harness daemon
  (:mod:`qwengyre.rollout.harnessd`), so they outlive this process: a resumed run's
  host lists them (:meth:`~LocalHarnessHost.survivors`) and re-adopts them
  (:meth:`~LocalHarnessHost.adopt`);
- :class:`~qwengyre.cluster.ray_harness.RayHarnessHost`: an async Ray actor pinned to
  one node (``harness.hosts=ray``), one per node.

:class:`HostPool` spreads executions over its hosts by free capacity: a new execution
goes to the host with the most free slots (then the fewest running, then the first);
no host runs more than its ``capacity``; when every host is full the execution waits
for a slot. The pool remembers which host runs which execution, so a cancel goes there.
The controller talks only to the pool, so a new kind of host changes no controller code.
An adopted execution goes back to the host that reported it, whatever its free slots.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from qwengyre.config import EvaluationConfig
from qwengyre.rollout.assessments import AssessmentHub
from qwengyre.rollout.execution import Budgets, ExecutionResult, run_execution
from qwengyre.rollout.harness import HarnessRunner, HarnessSpec, kill_orphaned_harnesses, supervise
from qwengyre.rollout.harnessd import HarnessDaemon
from qwengyre.rollout.sandbox import Sandbox
from qwengyre.rollout.tasks import Task
from qwengyre.types import Outcome

__all__ = ["ExecutionRequest", "HarnessHost", "HostPool", "LocalHarnessHost"]


@dataclass(kw_only=True, frozen=True)
class ExecutionRequest:
    """Everything a host needs to run one execution (picklable: it travels to a node).

    ``base_url`` and ``api_key`` are the proxy's for this execution
    (:meth:`~qwengyre.proxy.server.ProxyServer.create_execution`); the URL must be
    reachable from the host's machine. An adopted execution's harness already has
    them: its request carries an empty key.
    """

    task: Task
    harness: HarnessSpec
    budgets: Budgets
    execution_id: str
    base_url: str
    api_key: str
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)


class HarnessHost(Protocol):
    """Runs executions on one machine; at most ``capacity`` at once (the pool's rule)."""

    name: str
    capacity: int

    async def run(self, request: ExecutionRequest) -> ExecutionResult:
        """Run the execution to its one outcome; ``result.host`` is this host's name."""
        ...

    async def cancel(self, execution_id: str) -> None:
        """Stop a running execution (its harness is killed, outcome ``cancelled``);
        one not running here is left alone."""
        ...

    async def close(self, *, keep_harnesses: bool = False) -> None:
        """Stop every execution here (harnesses killed) and release the host.
        ``keep_harnesses``: stop watching them instead, leaving those under a harness
        daemon running for a resumed run to re-adopt (others are killed)."""
        ...

    async def adopt(self, request: ExecutionRequest) -> ExecutionResult:
        """Wait for the harness a dead controller started for the execution (one of
        :meth:`survivors`), then evaluate it: its one outcome, as :meth:`run`'s."""
        ...

    async def survivors(self) -> list[str]:
        """The executions whose harnesses a dead controller left here that can be
        adopted: still running, or ended with their exit status known."""
        ...

    async def stop_orphans(self, keep: Collection[str] = ()) -> int:
        """Kill the harnesses a killed run left on this host's machine, under its
        directory, but those of the executions in ``keep`` (a resumed run calls it
        before it starts executions); how many."""
        ...

    async def check_sandbox(self, sandbox: Sandbox) -> None:
        """Raise :class:`~qwengyre.rollout.sandbox.SandboxUnavailable` if ``sandbox``
        cannot run on this host's machine."""
        ...


class LocalHarnessHost:
    """Executions in this process: workspaces and logs under ``run_dir``, intermediate
    assessments and model-call counts through ``hub`` (the proxy, or a stand-in for it
    on another node); ``daemon``: harnesses under the directory's harness daemon."""

    def __init__(
        self,
        run_dir: Path,
        *,
        capacity: int,
        hub: AssessmentHub | None = None,
        name: str = "local",
        daemon: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"harness host {name!r}: capacity must be >= 1, got {capacity}")
        self.run_dir = Path(run_dir)
        self.capacity = capacity
        self.hub = hub
        self.name = name
        self.daemon = HarnessDaemon(self.run_dir) if daemon else None
        self._runner: HarnessRunner = self.daemon.run if self.daemon else supervise
        self._running: dict[str, tuple[asyncio.Event, asyncio.Task[ExecutionResult]]] = {}

    def start(
        self, request: ExecutionRequest, *, adopted: bool = False
    ) -> asyncio.Task[ExecutionResult]:
        """Begin the execution (``adopted``: wait for the harness a dead controller
        started, :meth:`adopt`); :meth:`cancel` reaches it from the moment this returns."""
        execution_id = request.execution_id
        if execution_id in self._running:
            raise ValueError(f"execution {execution_id} is already running on {self.name}")
        if adopted and self.daemon is None:
            raise ValueError(f"harness host {self.name} has no harness daemon to adopt from")
        cancel = asyncio.Event()
        task = asyncio.ensure_future(self._execute(request, cancel, adopted))
        self._running[execution_id] = (cancel, task)
        task.add_done_callback(lambda _: self._running.pop(execution_id, None))
        return task

    async def run(self, request: ExecutionRequest) -> ExecutionResult:
        return await self.start(request)

    async def adopt(self, request: ExecutionRequest) -> ExecutionResult:
        return await self.start(request, adopted=True)

    async def _execute(
        self, request: ExecutionRequest, cancel: asyncio.Event, adopted: bool
    ) -> ExecutionResult:
        attach = None
        if adopted and self.daemon is not None:
            attach = functools.partial(self.daemon.attach, request.execution_id)
        result = await run_execution(
            request.task,
            request.harness,
            request.budgets,
            execution_id=request.execution_id,
            run_dir=self.run_dir,
            base_url=request.base_url,
            api_key=request.api_key,
            cancel=cancel,
            evaluation=request.evaluation,
            hub=self.hub,
            runner=self._runner,
            adopt=attach,
        )
        return replace(result, host=self.name)

    async def cancel(self, execution_id: str) -> None:
        running = self._running.get(execution_id)
        if running is not None:
            running[0].set()

    async def survivors(self) -> list[str]:
        if self.daemon is None:
            return []
        return [s.execution_id for s in await self.daemon.states() if not s.lost]

    async def stop_orphans(self, keep: Collection[str] = ()) -> int:
        if self.daemon is None:
            return kill_orphaned_harnesses(self.run_dir, keep)
        states = await self.daemon.states()
        orphans = [s.execution_id for s in states if s.running and s.execution_id not in keep]
        for execution_id in orphans:
            await self.daemon.state("kill", execution_id)
        # and any a run without the daemon left
        known = {s.execution_id for s in states}
        return len(orphans) + kill_orphaned_harnesses(self.run_dir, {*keep, *known})

    async def check_sandbox(self, sandbox: Sandbox) -> None:
        await asyncio.to_thread(sandbox.check)

    async def close(self, *, keep_harnesses: bool = False) -> None:
        running = list(self._running.values())
        keep = keep_harnesses and self.daemon is not None
        for cancel, task in running:
            if keep:
                task.cancel()  # the watcher only: the daemon keeps the harness
            else:
                cancel.set()
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        if self.daemon is not None and not keep:
            await self.daemon.shutdown()  # the run is over: the daemon too


def _cancelled_before_start(request: ExecutionRequest, why: str) -> ExecutionResult:
    """The result of an execution cancelled before any host ran it."""
    now = time.monotonic()
    return ExecutionResult(
        execution_id=request.execution_id,
        task_id=request.task.id,
        outcome=Outcome.CANCELLED,
        reward=None,
        started_s=now,
        ended_s=now,
        harness=None,
        assessments=(),
        detail=why,
    )


class HostPool:
    """Spreads executions over ``hosts`` by free capacity (module docstring)."""

    def __init__(self, hosts: Sequence[HarnessHost]) -> None:
        names = [host.name for host in hosts]
        if not hosts or len(set(names)) != len(names):
            raise ValueError(f"a host pool needs one or more hosts of distinct names, got {names}")
        self.hosts = list(hosts)
        self._running = [0] * len(self.hosts)
        self._where: dict[str, int] = {}  # execution id -> index of the host running it
        self._cancelled: set[str] = set()  # cancelled before they got a host
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    @property
    def capacity(self) -> int:
        """Executions the pool runs at once (more wait for a slot)."""
        return sum(host.capacity for host in self.hosts)

    def running(self) -> dict[str, int]:
        """Executions running now, by host name."""
        return {host.name: n for host, n in zip(self.hosts, self._running, strict=True)}

    async def run(self, request: ExecutionRequest) -> ExecutionResult:
        """Run ``request`` on the host with the most free slots, waiting for one if all
        are full. One cancelled before it got a host is not run (outcome ``cancelled``,
        ``host`` empty). A host that raises frees its slot; the error propagates."""
        execution_id = request.execution_id
        index = await self._acquire(execution_id)
        if index is None:
            return _cancelled_before_start(request, "cancelled before a harness host was free")
        self._where[execution_id] = index
        try:
            return await self.hosts[index].run(request)
        finally:
            del self._where[execution_id]
            self._running[index] -= 1
            self._wake()

    async def adopt(self, request: ExecutionRequest, host: str) -> ExecutionResult:
        """Adopt the execution on ``host`` (the one whose :meth:`HarnessHost.survivors`
        named it), taking a slot there even past its capacity: its harness already runs."""
        index = [h.name for h in self.hosts].index(host)
        self._running[index] += 1
        self._where[request.execution_id] = index
        try:
            return await self.hosts[index].adopt(request)
        finally:
            del self._where[request.execution_id]
            self._running[index] -= 1
            self._wake()

    async def survivors(self) -> dict[str, str]:
        """Every host's :meth:`HarnessHost.survivors`: the host name by execution id."""
        found = await asyncio.gather(*(host.survivors() for host in self.hosts))
        return {e: host.name for host, ids in zip(self.hosts, found, strict=True) for e in ids}

    async def cancel(self, execution_id: str) -> None:
        """Cancel on the host that runs it; one that has no host yet (or whose
        :meth:`run` has not been called yet) will not start. Call it only for an
        execution whose :meth:`run` has not returned: the pool keeps a cancel it cannot
        place until that run comes."""
        index = self._where.get(execution_id)
        if index is not None:
            await self.hosts[index].cancel(execution_id)
            return
        self._cancelled.add(execution_id)
        self._wake()

    async def check_sandbox(self, sandbox: Sandbox) -> None:
        """Every host's :meth:`HarnessHost.check_sandbox`: a run must not start whose
        harnesses cannot start on some node."""
        await asyncio.gather(*(host.check_sandbox(sandbox) for host in self.hosts))

    async def stop_orphans(self, keep: Collection[str] = ()) -> dict[str, int]:
        """Every host's :meth:`HarnessHost.stop_orphans` (sparing ``keep``), by host name."""
        counts = await asyncio.gather(*(host.stop_orphans(keep) for host in self.hosts))
        return {host.name: n for host, n in zip(self.hosts, counts, strict=True)}

    async def close(self, *, keep_harnesses: bool = False) -> None:
        """No execution starts any more; every host is closed (its harnesses killed, or
        with ``keep_harnesses`` left to their daemons: :meth:`HarnessHost.close`)."""
        self._closed = True
        self._wake()
        await asyncio.gather(*(host.close(keep_harnesses=keep_harnesses) for host in self.hosts))

    async def _acquire(self, execution_id: str) -> int | None:
        """The index of the host that takes the execution (its slot counted), or None
        when it was cancelled (or the pool closed) before a slot was free."""
        while True:
            if execution_id in self._cancelled or self._closed:
                self._cancelled.discard(execution_id)
                return None
            index = self._pick()
            if index is not None:
                self._running[index] += 1
                return index
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _pick(self) -> int | None:
        """The host with the most free slots, then the fewest running; None if all full."""
        free = [
            (host.capacity - n, -n, -i)
            for i, (host, n) in enumerate(zip(self.hosts, self._running, strict=True))
            if n < host.capacity
        ]
        return -max(free)[2] if free else None

    def _wake(self) -> None:
        """Every waiting execution looks again (in the order they came)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
