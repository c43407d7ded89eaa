"""Harness hosts on Ray nodes: ``harness.hosts=ray`` (:mod:`qwengyre.rollout.hosts`).

Each alive Ray node with CPUs gets one :class:`RayHarnessHost`: an async Ray actor
(:class:`HarnessActor`) pinned to the node with ``NodeAffinitySchedulingStrategy``. It
runs its executions there with :class:`~qwengyre.rollout.hosts.LocalHarnessHost`: the
workspaces and logs under ``harness.dir`` on that node (default: the run
directory's path, which is the same directory on every node when the run directory is
on a shared filesystem, and otherwise a directory of that name on each node), the
harnesses as process groups it kills on cancel and on close, the evaluation on the
node, next to the workspace. The actor reserves no CPU (``num_cpus=0``): the harnesses
are subprocesses of the node's harness daemon, outside Ray's accounting, and
``train``'s cells may hold every CPU of a node in their placement group.

- **Proxy.** A harness calls the proxy at its execution's ``base_url``, which every
  node must reach: ``train`` binds the proxy to ``proxy.host`` with Ray hosts
  (``0.0.0.0``: all interfaces, advertised at this node's address), and
  :func:`start_ray_hosts` refuses a loopback proxy when a node has another address.
- **Intermediate assessments.** The harness still asks only the proxy
  (``POST /x/{id}/assess``). For each execution the controller's side registers with
  the proxy an assessor that forwards to the actor's :meth:`HarnessActor.assess`, which
  answers with the execution's own assessor: the evaluation runs on the workspace's node.
- **Model-call counts.** An execution whose harness failed without touching its
  workspace asks how many model calls it made
  (:func:`~qwengyre.rollout.execution.infrastructure_failure`). The actor cannot call
  back into the controller, so it reads the execution's tree from the proxy's admin API
  (``GET /admin/executions/{id}/tree``): it holds the proxy's admin token for that.
- **Cancel.** An execution starts in two calls, ``start`` then ``result``, so that a
  cancel reaches the actor only once the execution is registered there.
- **Sandbox.** ``harness.sandbox`` confines the harnesses on every node; ``train`` checks
  on each node that it can run there (:meth:`RayHarnessHost.check_sandbox`) before
  any execution starts. A sandboxed harness's proxy relay runs in the node's actor.
- **Failure.** A host whose actor dies fails its calls with
  :class:`~qwengyre.cluster.local.ActorDied`, which stops the run as a dead cell does.
  Its harnesses run under the node's harness daemon (:mod:`qwengyre.rollout.harnessd`,
  started by the actor's host for ``harness.dir``), which outlives the actor and the
  driver; :meth:`close` stops them first. When the whole run was killed (and its actors
  with it), the resumed run's new actor on each node lists the daemon's harnesses
  (:meth:`survivors`), re-adopts those of the executions still in rollout
  (:meth:`adopt`) and stops the others (:meth:`stop_orphans`).

The actor does not block its event loop: harnesses are subprocesses, evaluators run in
subprocesses or threads, and the admin API is read with aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from qwengyre.cluster.local import ActorDied, ActorError
from qwengyre.rollout.assessments import AssessmentHub, AssessmentUnavailable, Assessor
from qwengyre.rollout.execution import ExecutionResult
from qwengyre.rollout.hosts import ExecutionRequest, LocalHarnessHost
from qwengyre.rollout.sandbox import Sandbox, SandboxUnavailable

__all__ = [
    "HarnessActor",
    "RayHarnessHost",
    "RayNode",
    "RecordedCalls",
    "harness_nodes",
    "require_ray",
    "start_ray_hosts",
]

CLOSE_TIMEOUT_S = 60.0
"""How long :meth:`RayHarnessHost.close` waits for the node's harnesses to be stopped."""

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class RayNode:
    """A Ray node that hosts harnesses."""

    node_id: str
    address: str

    @property
    def name(self) -> str:
        """The host's name: the node's address and the start of its id (several nodes
        may share an address)."""
        return f"{self.address}/{self.node_id[:8]}"


def require_ray() -> None:
    """Raise ``ValueError`` unless this process is connected to Ray."""
    if not ray.is_initialized():
        raise ValueError(
            "harness.hosts=ray needs Ray: set run.placement=ray (which starts or joins "
            "Ray), or initialise Ray (ray.init) before the run starts"
        )


def harness_nodes() -> list[RayNode]:
    """The alive nodes with CPUs of the Ray cluster this process is connected to
    (``ValueError`` when not connected, or when there is none)."""
    require_ray()
    nodes = [
        RayNode(node["NodeID"], node["NodeManagerAddress"])
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("CPU", 0) > 0
    ]
    if not nodes:
        raise ValueError("harness.hosts=ray: the Ray cluster has no alive node with CPUs")
    return nodes


@dataclass(frozen=True)
class RecordedCalls:
    """An execution's recorded model calls as the proxy's admin API lists them: what
    :func:`~qwengyre.rollout.execution.run_execution` counts (``len(nodes)``)."""

    nodes: tuple[Mapping[str, Any], ...]


class _NodeHub:
    """The proxy as an execution on a node sees it (an
    :class:`~qwengyre.rollout.assessments.AssessmentHub`): the executions' assessors
    are kept here, for :meth:`assess`; trees come from the admin API."""

    def __init__(self, proxy_url: str, admin_token: str) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self._admin = {"authorization": f"Bearer {admin_token}"}
        self._assessors: dict[str, Assessor] = {}

    def register_assessor(self, execution_id: str, assessor: Assessor) -> None:
        self._assessors[execution_id] = assessor

    def unregister_assessor(self, execution_id: str) -> None:
        self._assessors.pop(execution_id, None)

    async def assess(self, execution_id: str, branch: int | None) -> Mapping[str, Any]:
        assessor = self._assessors.get(execution_id)
        if assessor is None:
            raise AssessmentUnavailable(f"execution {execution_id} has no harness running here")
        return await assessor(branch)

    async def tree(self, execution_id: str) -> RecordedCalls:
        url = f"{self.proxy_url}/admin/executions/{execution_id}/tree"
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, headers=self._admin) as response,
        ):
            response.raise_for_status()
            return RecordedCalls(tuple((await response.json())["nodes"]))


class HarnessActor:
    """The node's side of a :class:`RayHarnessHost` (an async Ray actor)."""

    def __init__(
        self, name: str, harness_dir: str, capacity: int, proxy_url: str, admin_token: str
    ) -> None:
        self.hub = _NodeHub(proxy_url, admin_token)
        self.host = LocalHarnessHost(
            Path(harness_dir), capacity=capacity, hub=self.hub, name=name, daemon=True
        )
        self._runs: dict[str, asyncio.Task[ExecutionResult]] = {}

    async def where(self) -> tuple[str, int]:
        """This node's Ray id and this process's id (the harnesses' parent)."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    async def start(self, request: ExecutionRequest, adopted: bool = False) -> None:
        """Begin the execution (``adopted``: re-adopt its running harness); a
        :meth:`cancel` sent after this returned reaches it."""
        self._runs[request.execution_id] = self.host.start(request, adopted=adopted)

    async def result(self, execution_id: str) -> ExecutionResult:
        """The outcome of an execution :meth:`start` began."""
        try:
            return await self._runs[execution_id]
        finally:
            del self._runs[execution_id]

    async def cancel(self, execution_id: str) -> None:
        await self.host.cancel(execution_id)

    async def assess(self, execution_id: str, branch: int | None) -> Mapping[str, Any]:
        """An intermediate assessment of the execution's workspace, now."""
        return await self.hub.assess(execution_id, branch)

    async def survivors(self) -> list[str]:
        return await self.host.survivors()

    async def stop_orphans(self, keep: Collection[str] = ()) -> int:
        return await self.host.stop_orphans(keep)

    async def check_sandbox(self, sandbox: Sandbox) -> None:
        await self.host.check_sandbox(sandbox)

    async def close(self, keep_harnesses: bool = False) -> None:
        await self.host.close(keep_harnesses=keep_harnesses)


class RayHarnessHost:
    """A harness host on one Ray node (:class:`~qwengyre.rollout.hosts.HarnessHost`),
    driven from the controller's process; ``hub`` is the proxy, which gets a forwarding
    assessor for each execution (module docstring)."""

    def __init__(
        self,
        node: RayNode,
        *,
        capacity: int,
        harness_dir: Path,
        hub: AssessmentHub,
        proxy_url: str,
        admin_token: str,
    ) -> None:
        self.name = node.name
        self.capacity = capacity
        self.node = node
        self._hub = hub
        self._cancels: dict[str, asyncio.Event] = {}
        actor = ray.remote(HarnessActor).options(
            num_cpus=0,
            # a run and an assessment per execution, and cancels and close beside them
            max_concurrency=2 * capacity + 8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        )
        self._actor: Any = actor.remote(  # Ray's typing of handles is partial
            self.name, str(harness_dir), capacity, proxy_url, admin_token
        )

    async def run(self, request: ExecutionRequest, adopted: bool = False) -> ExecutionResult:
        execution_id = request.execution_id
        cancel = self._cancels[execution_id] = asyncio.Event()
        self._hub.register_assessor(execution_id, functools.partial(self._assess, execution_id))
        try:
            await self._call("start", request, adopted)
            return await self._result(execution_id, cancel)
        finally:
            self._hub.unregister_assessor(execution_id)
            del self._cancels[execution_id]

    async def _result(self, execution_id: str, cancel: asyncio.Event) -> ExecutionResult:
        """The started execution's result; a cancel meanwhile is passed on to the actor."""
        result = asyncio.ensure_future(self._call("result", execution_id))
        stop = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({result, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                await self._call("cancel", execution_id)
            return await result
        finally:
            stop.cancel()
            result.cancel()

    async def cancel(self, execution_id: str) -> None:
        event = self._cancels.get(execution_id)
        if event is not None:
            event.set()

    async def where(self) -> tuple[str, int]:
        """The actor's node id and process id (the parent of its harnesses)."""
        node_id, pid = await self._call("where")
        return str(node_id), int(pid)

    async def adopt(self, request: ExecutionRequest) -> ExecutionResult:
        """Re-adopt a harness the node's daemon kept running (:meth:`survivors`)."""
        return await self.run(request, adopted=True)

    async def survivors(self) -> list[str]:
        """The node daemon's harnesses a resumed run can adopt."""
        return [str(e) for e in await self._call("survivors")]

    async def stop_orphans(self, keep: Collection[str] = ()) -> int:
        """Kill the harnesses a killed run left on the node but ``keep``'s."""
        return int(await self._call("stop_orphans", list(keep)))

    async def check_sandbox(self, sandbox: Sandbox) -> None:
        """Check ``sandbox`` on the node; its SandboxUnavailable names the node."""
        try:
            await self._call("check_sandbox", sandbox)
        except ActorError as exc:
            cause = getattr(exc.__cause__, "cause", None)  # what the actor raised
            if isinstance(cause, SandboxUnavailable):
                raise SandboxUnavailable(f"harness host {self.name}: {cause}") from None
            raise

    async def close(self, *, keep_harnesses: bool = False) -> None:
        """Stop the node's harnesses (bounded by :data:`CLOSE_TIMEOUT_S`; with
        ``keep_harnesses`` only the actor's watchers), then the actor."""
        try:
            with contextlib.suppress(ActorDied, TimeoutError):
                await asyncio.wait_for(self._call("close", keep_harnesses), CLOSE_TIMEOUT_S)
        finally:
            ray.kill(self._actor, no_restart=True)

    async def _assess(self, execution_id: str, branch: int | None) -> Mapping[str, Any]:
        """The forwarding assessor the proxy calls: the actor assesses, on its node."""
        try:
            return dict(await self._call("assess", execution_id, branch))
        except ActorError as exc:
            cause = getattr(exc.__cause__, "cause", None)  # what the actor raised
            if isinstance(cause, LookupError):  # the proxy answers it as a 404
                raise AssessmentUnavailable(str(cause)) from None
            raise

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._actor, method).remote(*args)
        except RayTaskError as exc:
            raise ActorError(f"harness host {self.name}: {exc}") from exc
        except RayActorError as exc:
            raise ActorDied(f"harness host {self.name} died: {exc}") from exc


def start_ray_hosts(
    nodes: Sequence[RayNode],
    *,
    capacity: int,
    harness_dir: Path,
    hub: AssessmentHub,
    proxy_url: str,
    admin_token: str,
) -> list[RayHarnessHost]:
    """One host per node, ``capacity`` executions each, the proxy at ``proxy_url``.

    Raises ``ValueError`` when the proxy listens on a loopback address and a node has
    another address (its harnesses could not reach it).
    """
    here = ray.util.get_node_ip_address()
    elsewhere = [n.address for n in nodes if n.address != here]
    if urlsplit(proxy_url).hostname in _LOOPBACK and elsewhere:
        raise ValueError(
            f"harness.hosts=ray: the proxy at {proxy_url} is reachable from this machine"
            f" only, and node {elsewhere[0]} runs harnesses; set proxy.host=0.0.0.0 (or an"
            " address every node reaches)"
        )
    return [
        RayHarnessHost(
            node,
            capacity=capacity,
            harness_dir=harness_dir,
            hub=hub,
            proxy_url=proxy_url,
            admin_token=admin_token,
        )
        for node in nodes
    ]
