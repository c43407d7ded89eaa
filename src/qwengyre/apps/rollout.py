"""Rollout without training: run a task set through the proxy and an engine, record everything.

``qwengyre rollout`` — the evaluation mode users run on a checkpoint (``model.path``: a
HuggingFace directory, which ``qwengyre model export`` makes of one). For every task,
N executions run (bounded concurrency) with a harness that reaches the model only
through an in-process proxy (the engine of ``engine.backend``: embedded, or a vLLM /
SGLang server launched for the run). Each finished execution is committed to
the run's SQLite store (the same file as the proxy's TITO records) before it counts,
appends every one of its assessments (final attempts, intermediate ones, placeholders)
to ``assessments.jsonl`` (:class:`~qwengyre.rollout.assessments.AssessmentLog`) and
one line to ``traces.jsonl`` in the simulator's replay format. The in-process proxy
serves each running execution's intermediate assessments (``POST /x/{id}/assess``). With
``resume`` a restarted run skips executions already committed, stops the harnesses a
killed runner orphaned, and re-runs the rest (an execution whose runner died has no
result, so it runs again, under a new id). An execution's assessments are written just
before its result is committed, so a runner killed between the two leaves log lines of
an execution with no committed result: readers join the log with the committed results.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from qwengyre.apps.preflight import checked_harness
from qwengyre.apps.serve import close_engine, load_tokenizer, model_dir, model_engine
from qwengyre.config import Config, GroupsConfig
from qwengyre.engines.factory import server_backend
from qwengyre.proxy.build import build_proxy
from qwengyre.proxy.server import ProxyServer
from qwengyre.records.assessments import ASSESSMENTS_FILE, AssessmentLog
from qwengyre.records.trace import TraceWriter
from qwengyre.rollout.execution import Budgets, ExecutionResult, run_execution, trace_record
from qwengyre.rollout.groups import group_advantages
from qwengyre.rollout.harness import HarnessSpec, kill_orphaned_harnesses
from qwengyre.rollout.tasks import Task
from qwengyre.rollout.toy_tasks import toy_tasks_path
from qwengyre.rollout.workloads import load_task_source
from qwengyre.runtime.lock import lock_run_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollout_results (
    task TEXT NOT NULL, idx INTEGER NOT NULL, execution TEXT NOT NULL, outcome TEXT NOT NULL,
    reward REAL, duration_s REAL NOT NULL, detail TEXT NOT NULL, assessments TEXT NOT NULL,
    PRIMARY KEY (task, idx));
CREATE TABLE IF NOT EXISTS rollout_groups (
    task TEXT PRIMARY KEY, status TEXT NOT NULL, advantages TEXT NOT NULL);
"""


ENGINE_CAPACITY = 32
"""Requests the model's engine serves at once: more than the executions, whose harnesses
may call in parallel (sub-agents), so that no call waits for a slot."""


@dataclass(frozen=True)
class RolloutOptions:
    """One ``qwengyre rollout``. Its settings are the config tree's, as ``train`` reads
    them: ``model`` (the model), ``harness`` (which harness, the tasks, the budgets, the
    sandbox), ``groups`` (``size``: N valid rewards per task, ``oversample``,
    ``min_valid``), ``cells.capacity`` (executions at once), ``engine`` (``backend``,
    ``dtype``, ``max_context``), ``run.device``, ``trainer.temperature`` and
    ``evaluation``. The run directory and ``resume`` are the invocation's own."""

    run_dir: Path
    config: Config
    resume: bool = False
    log: Callable[[str], None] = print  # a line per execution that ends: the progress


class ResultStore:
    """Finished executions, committed before they count (WAL, like the proxy's store)."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def done(self) -> set[tuple[str, int]]:
        return {(t, i) for t, i in self._db.execute("SELECT task, idx FROM rollout_results")}

    def add(self, index: int, result: ExecutionResult) -> None:
        assessments = json.dumps([a.to_dict() for a in result.assessments])
        self._db.execute(
            "INSERT INTO rollout_results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                result.task_id,
                index,
                result.execution_id,
                result.outcome.value,
                result.reward,
                result.ended_s - result.started_s,
                result.detail,
                assessments,
            ),
        )

    def rows(self) -> list[tuple[str, int, str, float | None]]:
        return list(self._db.execute("SELECT task, idx, outcome, reward FROM rollout_results"))

    def valid(self, task: str) -> dict[int, float]:
        """Committed valid rewards of a task's executions, by index."""
        rows = self._db.execute(
            "SELECT idx, reward FROM rollout_results WHERE task = ? AND reward IS NOT NULL"
            " ORDER BY rowid",
            (task,),
        )
        return dict(rows.fetchall())

    def set_group(self, task: str, status: str, advantages: dict[int, float]) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO rollout_groups VALUES (?, ?, ?)",
            (task, status, json.dumps({str(k): v for k, v in advantages.items()})),
        )

    def groups(self) -> dict[str, tuple[str, dict[int, float]]]:
        rows = self._db.execute("SELECT task, status, advantages FROM rollout_groups")
        return {
            t: (status, {int(k): v for k, v in json.loads(adv).items()}) for t, status, adv in rows
        }

    def close(self) -> None:
        self._db.close()


async def rollout(options: RolloutOptions) -> list[tuple[str, int, str, float | None]]:
    """Run every (task, index) not yet committed; returns all committed results.

    Holds the run directory's lock throughout: a directory another run uses is refused
    with one line naming it, and a new run's directory must be empty (bar the lock file).
    Resuming an empty one runs everything, as a new run does. A sandbox that cannot run
    here raises :class:`~qwengyre.rollout.sandbox.SandboxUnavailable` first."""
    config = options.config
    harness = config.harness
    # What can be checked in seconds, before the model loads (as train's preflight).
    tasks = load_task_source(harness.tasks or toy_tasks_path())
    spec = checked_harness(harness)
    if config.engine.backend != "embedded":
        server_backend(config.engine.backend).require_installed()
    with lock_run_dir(options.run_dir, new=not options.resume):
        model = model_dir(config)
        tokenizer = load_tokenizer(model)
        with model_engine(
            model,
            config.engine,
            device=config.run.device,
            capacity=ENGINE_CAPACITY,
            max_context=config.engine.max_context,
        ) as engine:
            server = build_proxy(
                config.proxy,
                model,
                tokenizer,
                options.run_dir,
                max_context=config.engine.max_context,
                temperature=config.trainer.temperature,
                engines=[engine],
            )
            try:
                return await _rollout(options, tasks, spec, server)
            finally:
                await close_engine(engine)


async def _rollout(
    options: RolloutOptions, tasks: list[Task], spec: HarnessSpec, server: ProxyServer
) -> list[tuple[str, int, str, float | None]]:
    config = options.config
    harness, groups = config.harness, config.groups
    budgets = Budgets(harness.deadline_s, harness.budget_s)
    run_dir = options.run_dir
    results = ResultStore(run_dir / "proxy.sqlite")
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    server.base_url = url
    admin = {"authorization": f"Bearer {server.admin.token}"}
    done = results.done()
    if options.resume:  # harnesses a killed runner left behind must not keep running
        kill_orphaned_harnesses(run_dir)
    start_wall = time.time()
    planned = len(tasks) * (groups.size + groups.oversample)  # at most: surplus is cancelled
    ended: list[ExecutionResult] = []
    limit = asyncio.Semaphore(config.cells.capacity)
    assessments = AssessmentLog(run_dir / ASSESSMENTS_FILE)
    try:
        async with aiohttp.ClientSession() as http:
            with TraceWriter(run_dir / "traces.jsonl", fsync=True) as traces:

                async def one(task: Task, group: int, index: int, cancel: asyncio.Event) -> None:
                    async with limit:
                        if cancel.is_set():
                            return  # surplus: its group had N valid rewards before it launched
                        async with http.post(url + "/admin/executions", headers=admin) as r:
                            execution = await r.json()
                        began = time.time() - start_wall
                        result = await run_execution(
                            task,
                            spec,
                            budgets,
                            execution_id=execution["id"],
                            run_dir=run_dir,
                            base_url=execution["base_url"],
                            api_key=execution["key"],
                            cancel=cancel,
                            evaluation=config.evaluation,
                            hub=server,
                        )
                        tree_url = f"{url}/admin/executions/{execution['id']}/tree"
                        async with http.get(tree_url, headers=admin) as r:
                            nodes = (await r.json())["nodes"]
                        assessments.write(
                            result.execution_id,
                            group,
                            index,
                            result.assessments,
                            task_id=task.id,
                        )
                        results.add(index, result)  # durable before it counts
                        traces.write(
                            trace_record(task, group, index, result, began, nodes, start_wall)
                        )
                        ended.append(result)
                        reward = "no valid reward" if result.reward is None else result.reward
                        options.log(
                            f"[{len(done) + len(ended)}/{planned}] {task.id} #{index}:"
                            f" {result.outcome.value}, {reward}"
                            f" ({time.time() - start_wall:.0f} s)"
                        )

                async def group_of(task: Task, group: int) -> None:
                    n, total = groups.size, groups.size + groups.oversample
                    cancels = {i: asyncio.Event() for i in range(total)}

                    async def index(i: int) -> None:
                        await one(task, group, i, cancels[i])
                        if len(results.valid(task.id)) >= n:  # cancel the surplus
                            for event in cancels.values():
                                event.set()

                    if len(results.valid(task.id)) < n:
                        missing = [i for i in range(total) if (task.id, i) not in done]
                        await asyncio.gather(*(index(i) for i in missing))
                    status, advantages = group_outcome(results.valid(task.id), groups)
                    results.set_group(task.id, status, advantages)

                await asyncio.gather(*(group_of(t, g) for g, t in enumerate(tasks)))
        return results.rows()
    finally:
        results.close()
        await runner.cleanup()
        server.store.close()


def group_outcome(valid: dict[int, float], groups: GroupsConfig) -> tuple[str, dict[int, float]]:
    """``ready`` (the first N valid rewards), ``short`` (fewer, but >= min_valid: their own
    statistics) or ``dropped`` — never invented zeros. Advantages as ``train`` computes
    them (not scaled by the standard deviation)."""
    if len(valid) >= groups.size:
        return "ready", group_advantages(dict(list(valid.items())[: groups.size]))
    if groups.min_valid is not None and len(valid) >= max(2, groups.min_valid):
        return "short", group_advantages(valid)
    return "dropped", {}


def summary(rows: list[tuple[str, int, str, float | None]]) -> str:
    outcomes = Counter(outcome for _, _, outcome, _ in rows)
    rewards = [r for *_, r in rows if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    parts = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
    return f"{len(rows)} executions ({parts}); mean valid reward {mean:.3f} over {len(rewards)}"
