"""Harness hosts on Ray nodes: on a two-node Ray cluster (each node its own
raylet, on this one machine) executions of the toy harness spread over both nodes; each
harness is a child of its node's host actor, its intermediate assessments are made
there, its model calls are counted through the proxy's admin API, a cancel kills the
harness on its node, and the hosts of a resumed run stop what a killed run left."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.test_proxy_server import ADMIN, Running, start
from tests.test_rollout_assessments import SCRIPT
from tests.test_rollout_hosts import gone, orphan

from qwengyre.apps.train import TrainOptions, train
from qwengyre.config import load_config
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.rollout.execution import Budgets
from qwengyre.rollout.harness import HarnessSpec, harness_spec
from qwengyre.rollout.hosts import ExecutionRequest, HostPool
from qwengyre.rollout.sandbox import Bubblewrap, NoSandbox, SandboxUnavailable
from qwengyre.rollout.tasks import CommandEvaluator, Task, load_tasks
from qwengyre.rollout.toy_tasks import toy_tasks_path
from qwengyre.types import Outcome

ray = pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")

# The grader says which process ran it: its parent, the host actor of the node.
WHERE = (
    "import json, os; "
    "print(json.dumps({'score': 1.0, 'valid': True, 'critique': f'by {os.getppid()}'}))"
)
# The harness notes its pid and its parent's (the host actor's), then becomes the
# command that follows.
PIDS = ("sh", "-c", 'echo "$$ $PPID" > "$1/pids"; shift; exec "$@"', "sh", "{home_dir}")


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)
    yield from start(tmp_path / "proxy", tiny_model_dir, engines=[engine], max_context=1_000_000)


def in_loop(proxy: Running, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` in the proxy's event loop (the controller's, in a run)."""
    return asyncio.run_coroutine_threadsafe(coro, proxy.loop).result(timeout=120)


async def request(proxy: Running, task: Task, spec: HarnessSpec) -> ExecutionRequest:
    ex = await proxy.server.create_execution()
    return ExecutionRequest(
        task=task,
        harness=spec,
        budgets=Budgets(40, 60),
        execution_id=ex["id"],
        base_url=ex["base_url"],
        api_key=ex["key"],
    )


async def pids(root: Path, execution_id: str) -> tuple[int, int]:
    """The harness's pid and its parent's, once it has written them."""
    path = root / "logs" / execution_id / "home" / "pids"
    while len(text := path.read_text().split() if path.exists() else []) < 2:
        await asyncio.sleep(0.05)
    return int(text[0]), int(text[1])


@pytest.mark.slow  # a two-node Ray cluster starts in ~8 s
def test_executions_spread_over_two_nodes_and_run_where_their_host_is(
    proxy: Running, two_ray_nodes: None, tmp_path: Path
) -> None:
    from qwengyre.cluster.ray_harness import harness_nodes, start_ray_hosts

    nodes = harness_nodes()
    assert len({n.node_id for n in nodes}) == 2
    root = tmp_path / "hosts"
    left = orphan(root, "ex_old")  # by a run killed with its actors
    hosts = start_ray_hosts(
        nodes,
        capacity=2,
        harness_dir=root,
        hub=proxy.server,
        proxy_url=proxy.url,
        admin_token=ADMIN,
    )
    pool = HostPool(hosts)
    evaluator = CommandEvaluator(command=[sys.executable, "-c", WHERE])
    tasks = [t.model_copy(update={"evaluator": evaluator}) for t in load_tasks(toy_tasks_path())]
    toy = harness_spec("toy-critique", 40)
    critique = replace(toy, command=(*PIDS, *toy.command))
    crash = HarnessSpec(command=("sh", "-c", "exit 3"), deadline_s=40)
    sleeper = HarnessSpec(command=(*PIDS, "sleep", "60"), deadline_s=40)

    async def scenario() -> tuple[Any, ...]:
        where = {host.name: await host.where() for host in hosts}
        stopped = await pool.stop_orphans()
        await pool.check_sandbox(NoSandbox())
        unavailable = r"harness host .*: harness\.sandbox=bwrap: no"
        with pytest.raises(SandboxUnavailable, match=unavailable):
            await pool.check_sandbox(Bubblewrap(binary="no-such-bwrap"))  # checked on the node
        toys = [await request(proxy, task, critique) for task in tasks[:4]]
        done = await asyncio.gather(*(pool.run(r) for r in toys))
        parents = [(await pids(root, r.execution_id))[1] for r in done]
        parents_are = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in set(parents)}
        crashed = await pool.run(await request(proxy, tasks[0], crash))
        sleeping = await request(proxy, tasks[0], sleeper)
        run = asyncio.ensure_future(pool.run(sleeping))
        harness, parent = await pids(root, sleeping.execution_id)
        (name,) = [n for n, running in pool.running().items() if running]
        await pool.cancel(sleeping.execution_id)
        cancelled = await run
        await pool.close()
        sleeping_parent = (name, harness, parent)
        return where, stopped, done, parents, parents_are, crashed, cancelled, sleeping_parent

    ran = in_loop(proxy, scenario())
    where, stopped, done, parents, parents_are, crashed, cancelled, (name, harness, parent) = ran
    assert {node for node, _ in where.values()} == {n.node_id for n in nodes}
    # The new actors stopped the harness the killed run left (both nodes share this disk).
    assert set(stopped) == set(where) and sum(stopped.values()) >= 1
    assert left.wait(10) == -9
    assert {host.name: host.node.node_id for host in hosts} == {h: n for h, (n, _) in where.items()}
    # Two executions on each node (two slots each), every one a child of the harness
    # daemon of its host's directory (one here: both nodes are this machine and disk).
    assert sorted(r.host for r in done) == sorted(2 * list(where))
    for result, harness_parent in zip(done, parents, strict=True):
        assert result.outcome is Outcome.COMPLETED and result.reward == 1.0, result
        actor_pid = where[result.host][1]
        command = parents_are[harness_parent].split(b"\0")
        assert b"qwengyre.rollout.harnessd" in command and str(root).encode() in command
        # The toy harness asked the proxy for a critique; the node's host made it.
        intermediate = [a for a in result.assessments if a.kind == "intermediate"]
        assert intermediate and all(a.critique == f"by {actor_pid}" for a in intermediate)
    # A crash that touched nothing: its model calls (none) came from the admin API.
    assert crashed.outcome is Outcome.FAILED and "made no model call" in crashed.detail
    # A cancel reached the node that ran the harness, and killed it there.
    assert cancelled.outcome is Outcome.CANCELLED and cancelled.host == name
    assert parent in parents_are and gone(harness)


def test_ray_hosts_need_ray_and_a_proxy_every_node_reaches(tmp_path: Path) -> None:
    from qwengyre.cluster.ray_harness import RayNode, start_ray_hosts

    assert not ray.is_initialized()
    config = load_config(None, ["harness.hosts=ray", "metrics.tensorboard=false"])
    options = TrainOptions(run_dir=tmp_path / "run", config=config, display=False)
    with pytest.raises(ValueError, match=r"harness\.hosts=ray needs Ray: set run\.placement=ray"):
        asyncio.run(train(options))  # at once, before the warm start
    far = RayNode("f" * 56, "10.255.0.1")
    refused = r"node 10\.255\.0\.1 runs harnesses; set proxy\.host=0\.0\.0\.0"
    with pytest.raises(ValueError, match=refused):
        start_ray_hosts(
            [far],
            capacity=1,
            harness_dir=tmp_path,
            hub=SimpleNamespace(),  # type: ignore[arg-type]  # refused before any use
            proxy_url="http://127.0.0.1:9",
            admin_token=ADMIN,
        )
