"""The live controller: the scheduler's actions carried out with the real clock
(docs/design.md §3; the paper: elastic cells, role transitions, streaming training).

The scheduler is the same pure state machine the simulator drives. Everything that
happens (an execution ends, a cell finished moving, a step's update is done, a
publication landed, a timer fired, the packing buffer runs low) becomes an event on
one queue, and the heart of the runtime is::

    event = await self.events.get()
    for action in self.scheduler.handle(event):
        await self.execute(action)

Actions start work and never wait for it: executions, cell moves, training steps and
publications run as tasks and answer with their events. Events are stamped with the
controller's clock when they are handled, so the scheduler sees time move forward.

Data flow: an execution runs its harness against the proxy (routed to the engine the
scheduler chose); when its group has its rewards, the group's trajectories are
admitted, appended to the ledger (durable) and put in the trajectory buffer. The
scheduler assigns ready groups to the open step; the packing buffer turns them into
micro-steps on the queue; every cell in training claims micro-steps; once the batch is
closed and drained, the participating prefix of cells reduces and the core updates.

A cell that dies, in any role, is replaced by a new process while
``run.replace_dead_cells`` allows, the core included (its replacement takes over the
newest published weights); otherwise a cell other than the core is lost, and the run
goes on without it (:class:`~qwengyre.scheduler.events.CellLost`): the proxy sends its
calls elsewhere (or holds them until an engine serves), its harnesses keep running, and
the live cells re-form their groups without it (:mod:`qwengyre.runtime.supervisor`). A
cell that leaves the open step before its update (it died, a cell before it died, or
the scheduler sent it back to rollout because no engine was left) gives the micro-steps
it claimed back to the queue, and the cells that stay train them
(:meth:`Controller._leave_step`): the update sums whole micro-steps, so it is the same as
if the cell had never joined. A death during the update fails it everywhere; the step is
then done if the core's weights moved on, else trained again
(:meth:`Controller._after_a_death_in_update`). The core's death with no replacement left
stops the run (``run.restarts`` may resume it from its checkpoint: :meth:`shutdown` then
leaves the harnesses running for the resumed run to re-adopt).
Every launch is journaled before its harness starts and every outcome before it counts
(:mod:`qwengyre.runtime.journal`): a controller resumed after its predecessor was killed
re-adopts the executions whose harnesses still run (the scheduler's :class:`Adopt`)
and evaluates each when its harness ends, as if it had launched it.
Watching the cells is the :class:`~qwengyre.runtime.supervisor.Supervisor`'s part; what
the run records (roles, switches, load, usage, steps) is the
:class:`~qwengyre.runtime.observer.Observer`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from qwengyre.cluster.client import CellClient, EngineClient
from qwengyre.cluster.local import ActorDied
from qwengyre.cluster.placement import engine_name
from qwengyre.config import Config
from qwengyre.proxy.server import ProxyServer
from qwengyre.records.assessments import AssessmentLog
from qwengyre.records.metrics import MetricsWriter
from qwengyre.records.trace import TraceWriter
from qwengyre.rollout.execution import Budgets, ExecutionResult, trace_record
from qwengyre.rollout.groups import group_advantages
from qwengyre.rollout.harness import HarnessSpec
from qwengyre.rollout.hosts import ExecutionRequest, HostPool
from qwengyre.rollout.tasks import Task
from qwengyre.runtime.journal import Adoption, LaunchJournal, LaunchRecord
from qwengyre.runtime.ledger import Ledger
from qwengyre.runtime.observer import Observer
from qwengyre.runtime.supervisor import Cluster, Supervisor
from qwengyre.scheduler.core import GroupState, Scheduler
from qwengyre.scheduler.events import (
    STANDALONE,
    Action,
    Adopt,
    AssignGroups,
    Cancel,
    CellLost,
    CellMoved,
    Dispatch,
    DropGroup,
    Event,
    ExecutionFinished,
    Launch,
    MoveCell,
    PublicationDone,
    Publish,
    PullGroups,
    Reroute,
    Role,
    Start,
    StepDone,
    Tick,
    WakeAt,
)
from qwengyre.training.backend import MicroStepResult, StepResult
from qwengyre.training.buffers import (
    ExecutionSample,
    GroupSample,
    MicroStepQueue,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.trajectories.selection import admit_execution
from qwengyre.types import Outcome

__all__ = ["HARNESS_START_CHECK", "Controller", "HarnessCannotStart", "RunOutputs"]

log = logging.getLogger(__name__)

HARNESS_START_CHECK = 4
"""Executions in a row, from a run's first, whose harness failed before any model call
that stop the run (:meth:`Controller._check_harness_starts`)."""


class HarnessCannotStart(ValueError):
    """The run's harness fails before its first model call, every time (not installed,
    not configured): the message says how, and where its output is."""


def _last_line(path: Path | None) -> str:
    """The last non-empty line of a harness's output file ("" if none)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines() if path else []
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


@dataclass(kw_only=True)
class RunOutputs:
    """Where the controller writes: metrics, traces, the ledger, assessments, the launch
    journal, checkpoints."""

    run_dir: Path
    metrics: MetricsWriter
    traces: TraceWriter
    ledger: Ledger
    assessments: AssessmentLog  # every assessment of every execution, durable
    journal: LaunchJournal  # every launch, finish and drop, durable

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass(kw_only=True)
class _Execution:
    id: int
    group: int
    index: int
    proxy_id: str
    started_s: float
    version: int  # the policy version published when it launched
    ended: bool = False  # its harness host answered: nothing left to cancel


@dataclass(kw_only=True)
class _Step:
    """One training step in flight: who trains it, what they produced."""

    step: int
    workers: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    window_open: bool = True  # cells may still join this batch
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set as a worker starts
    updating: bool = False  # the update's collectives began: no cell can leave any more
    results: list[MicroStepResult] = field(default_factory=list)
    started_s: float = 0.0
    micro_step_s: float = 0.0  # summed over cells


class Controller:
    """Drives one training run; see the module docstring."""

    def __init__(
        self,
        config: Config,
        scheduler: Scheduler,
        proxy: ProxyServer,
        cells: list[CellClient],
        tasks: Sequence[Task],
        harness: HarnessSpec,
        outputs: RunOutputs,
        *,
        hosts: HostPool,
        trajectories: TrajectoryBuffer | None = None,
        trained: Sequence[int] = (),
        standalone: EngineClient | None = None,
        adoption: Adoption | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        """``cells``: the run's list of cells, which a replacement's process takes its
        cell's place in (``cluster`` starts it: ``run.replace_dead_cells``)."""
        self.config = config
        self.scheduler = scheduler
        self.proxy = proxy
        self.cells = cells
        self.standalone = standalone  # the standalone pool's actor: rollout only
        self.tasks = list(tasks)
        self.harness = harness
        self.outputs = outputs
        self.hosts = hosts  # where executions run (qwengyre.rollout.hosts)
        self.budgets = Budgets(config.harness.deadline_s, config.harness.budget_s)
        self.evaluation = config.evaluation
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.trajectories = trajectories or TrajectoryBuffer()
        self.packing = PackingBuffer(self.trajectories, config.trainer.micro_step_tokens)
        self.queue = MicroStepQueue()
        self.trained: list[int] = list(trained)  # group ids, in training order
        self.rng = random.Random(config.seed)
        self._task_order = self.rng.sample(range(len(self.tasks)), len(self.tasks))
        self._group_task: dict[int, Task] = {}
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self._executions: dict[int, _Execution] = {}
        self._adoption = adoption or Adoption()
        self._harness_works = bool(self._adoption.launches)  # a resumed run's did start
        self._harness_failures = 0  # executions whose harness failed at start, so far
        by_id = {task.id: task for task in self.tasks}
        for record in self._adoption.launches:  # a dead controller's in-flight groups
            self._executions[record.execution] = _Execution(
                id=record.execution,
                group=record.group,
                index=record.index,
                proxy_id=record.proxy_id,
                started_s=max(0.0, record.time - self._wall0),
                version=record.version,
            )
            self._group_task[record.group] = by_id[record.task]
        self._buffered: set[int] = {g for g in self.trajectories.ready_ids()}
        self._synced: set[int] = {0}  # cells whose parameters equal the core's
        self._step: _Step | None = None
        self._pull_queued = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._freed: dict[int, str] = {}  # cell: how its engine freed memory (SwitchRecord)
        self._fresh: set[int] = set()  # replacements that have not served yet: no engine
        self.failure: BaseException | None = None
        self.observer = Observer(outputs.metrics, scheduler, self.now)
        self.supervisor = Supervisor(
            self.cells,
            standalone,
            scheduler,
            proxy.router,
            spawn=self._spawn,
            emit=self._emit,
            leave=self._leave_step,
            cluster=cluster,
            adopt=self._adopt_replacement,
            rejoin=self._rejoin,
            replacements=config.run.replace_dead_cells,
        )

    # ------------------------------------------------------------------ clock

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name or None)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()  # stop the run: a bug or a dead cell
            self.events.put_nowait(Tick(self.now()))

    def _emit(self, make: Callable[[float], Event]) -> None:
        self.events.put_nowait(make(self.now()))

    # ------------------------------------------------------------------ the heart

    async def run(self, start: Event) -> None:
        """Handle events until ``run.steps`` updates are published (or a task failed)."""
        self.observer.start()
        await self.handle(start)
        for cell, role in enumerate(self.scheduler.roles):  # async: cells that start training
            if role is Role.TRAINING:
                await self.proxy.router.drain(engine_name(cell))
                await self.cells[cell].release_engine()
        self._spawn(self.supervisor.watch())
        while not self.finished:
            event = await self.events.get()
            if self.failure is not None:
                raise await self.supervisor.root_cause(self.failure)
            if isinstance(event, CellLost) and self.scheduler.why_not_lose(event.cell):
                raise self.supervisor.lost[event.cell]  # it moved on since it died: not lost
            if isinstance(event, PullGroups):
                self._pull_queued = False
                if event.step != self.scheduler.version:
                    continue  # the step it asked for is over
            await self.handle(dataclasses.replace(event, time=self.now()))

    @property
    def finished(self) -> bool:
        s = self.scheduler
        return s.version >= self.config.run.steps and not s.publishing

    async def handle(self, event: Event) -> None:
        self.observer.account()
        actions = self.scheduler.handle(event)
        if isinstance(event, ExecutionFinished):  # buffered before these actions pack it
            await self._buffer_if_ready(self._executions[event.execution_id].group)
        elif isinstance(event, Start):  # resumed groups whose every execution had counted
            for group in self._adoption.groups:
                await self._buffer_if_ready(group.id)
        for action in actions:
            await self.execute(action)
        self.observer.observe()
        self._rejoin()  # cells that joined training
        self._maybe_pull()

    async def execute(self, action: Action) -> None:
        match action:
            case Dispatch():
                if not action.topup:
                    order = self._task_order[action.group_id % len(self._task_order)]
                    self._group_task[action.group_id] = self.tasks[order]
            case Launch():
                await self._launch(action)
            case Adopt():
                ex = self._executions[action.execution_id]
                self.proxy.router.assign(ex.proxy_id, engine_name(action.engine))
                self._spawn(self._run_execution(ex), name="execution")
            case Cancel():
                await self._cancel(self._executions[action.execution_id])
            case Reroute():
                proxy_id = self._executions[action.execution_id].proxy_id
                self.proxy.router.assign(proxy_id, engine_name(action.destination))
            case MoveCell():
                if action.role is Role.ROLLOUT:  # mid-step: no engine was left to serve
                    await self._leave_step(action.cell)
                self._spawn(self._move(action.cell, action.role))
            case AssignGroups():
                await self._assign(action)
            case DropGroup():
                log.info("group %d dropped: it cannot reach its valid rewards", action.group_id)
                await asyncio.to_thread(self.outputs.journal.drop, action.group_id)
            case Publish():
                self._spawn(self._publish(action.version))
            case WakeAt():
                delay = max(0.0, action.time - self.now())
                asyncio.get_running_loop().call_later(delay, self._emit, Tick)

    # ------------------------------------------------------------------ rollout

    async def _launch(self, action: Launch) -> None:
        info = await self.proxy.create_execution()
        self.proxy.router.assign(info["id"], engine_name(action.engine))
        ex = _Execution(
            id=action.execution_id,
            group=action.group_id,
            index=action.index,
            proxy_id=info["id"],
            started_s=self.now(),
            version=action.version,
        )
        self._executions[ex.id] = ex
        record = LaunchRecord(
            execution=ex.id,
            group=ex.group,
            index=ex.index,
            version=ex.version,
            v_d=self.scheduler.groups[ex.group].v_d,
            proxy_id=ex.proxy_id,
            task=self._group_task[ex.group].id,
            time=time.time(),
        )
        await asyncio.to_thread(self.outputs.journal.launch, record)  # before it starts
        self._spawn(self._run_execution(ex, info), name="execution")

    async def _run_execution(self, ex: _Execution, info: dict[str, str] | None = None) -> None:
        """Run the execution on a harness host to its outcome; without ``info`` (the
        proxy's URL and key) it is adopted: its harness runs already, on the host that
        reported it."""
        task = self._group_task[ex.group]
        request = ExecutionRequest(
            task=task,
            harness=self.harness,
            budgets=self.budgets,
            execution_id=ex.proxy_id,
            base_url=info["base_url"] if info else "",
            api_key=info["key"] if info else "",
            evaluation=self.evaluation,
        )
        if info is None:
            result = await self.hosts.adopt(request, self._adoption.hosts[ex.proxy_id])
        else:
            result = await self.hosts.run(request)
        ex.ended = True
        await asyncio.to_thread(  # durable before the execution counts
            self.outputs.assessments.write,
            ex.proxy_id,
            ex.group,
            ex.index,
            result.assessments,
            task_id=task.id,
        )
        await self.proxy.revoke_execution(ex.proxy_id)
        nodes = (await self.proxy.tree(ex.proxy_id)).to_json()["nodes"]
        self._check_harness_starts(result, made_calls=bool(nodes))
        record = trace_record(
            task, ex.group, ex.index, result, ex.started_s, nodes, self._wall0, ex.version
        )
        self.outputs.traces.write(record.model_copy(update={"host": result.host or None}))
        outcome, reward = result.outcome, result.reward
        await asyncio.to_thread(self.outputs.journal.finish, ex.id, outcome.value, reward)
        self._emit(lambda t: ExecutionFinished(t, ex.id, outcome, reward))

    def _check_harness_starts(self, result: ExecutionResult, *, made_calls: bool) -> None:
        """Stop the run (:class:`HarnessCannotStart`) when its first
        :data:`HARNESS_START_CHECK` executions all ended with a harness that could not
        start, or that failed before its first model call: a harness that is not
        installed, or not configured, must not look like a run that learns nothing."""
        if self._harness_works or result.outcome is Outcome.CANCELLED:
            return
        run = result.harness
        failed = run is not None and (not run.spawned or (run.exit_code != 0 and not made_calls))
        if not failed:
            self._harness_works = True
            return
        assert run is not None
        self._harness_failures += 1
        if self._harness_failures >= HARNESS_START_CHECK:
            raise HarnessCannotStart(
                f"harness {self.harness.command[0]!r} failed in each of the first"
                f" {self._harness_failures} executions before any model call: "
                f"{run.error or _last_line(run.stderr_path) or f'exit code {run.exit_code}'}"
                f" (its output: {run.stderr_path})"
            )

    async def _cancel(self, ex: _Execution) -> None:
        """Kill the execution's harness on its host; it ends ``cancelled``. The pool
        hears only of executions it has not answered yet (it would keep the others)."""
        if not ex.ended:
            await self.hosts.cancel(ex.proxy_id)

    async def _buffer_if_ready(self, group_id: int) -> None:
        """A group that has its valid rewards and is not buffered yet: admit its
        trajectories, ledger, buffer. Without streaming the scheduler may assign a group
        in the same event that made it ready, so an assigned group counts too."""
        group = self.scheduler.groups[group_id]
        if group.state not in (GroupState.READY, GroupState.ASSIGNED) or group_id in self._buffered:
            return
        advantages = group_advantages(group.valid)
        executions = []
        for eid in sorted(group.valid):
            proxy_id = self._executions[eid].proxy_id
            tree = await self.proxy.tree(proxy_id)
            admitted = admit_execution(
                tree, proxy_id, advantages[eid], j_max=self.config.trainer.j_max, rng=self.rng
            )
            executions.append(ExecutionSample(proxy_id, advantages[eid], tuple(admitted)))
        sample = GroupSample(group_id, group.v_d, tuple(executions))
        self.outputs.ledger.append(sample, group.valid)  # durable before it can be trained
        self.trajectories.add(sample)
        self._buffered.add(group_id)

    # ------------------------------------------------------------------ cells

    async def _move(self, cell: int, role: Role) -> None:
        """A role switch (the paper §role transitions); answers with CellMoved. A cell
        that dies switching is lost (the core stops the run), or its replacement
        switches."""
        start = self.now()
        while True:
            try:
                await self._switch(cell, role)
                break
            except ActorDied as died:
                await self.supervisor.lose(cell, died)
                if cell in self.supervisor.lost:
                    return
        to = "training" if role is Role.TRAINING else "rollout"
        how = self._freed.get(cell, "")  # the way back undoes what the way out did
        self.observer.switch(cell, to, self.now() - start, how)
        self._emit(lambda t: CellMoved(t, cell))

    async def _switch(self, cell: int, role: Role) -> None:
        name = engine_name(cell)
        if role is Role.TRAINING:
            await self.proxy.router.drain(name)  # calls in flight retry elsewhere
            fresh = cell in self._fresh  # a replacement that never served: nothing to free
            self._freed[cell] = "" if fresh else await self.cells[cell].release_engine()
        elif cell in self._fresh:
            await self._serve(cell, self.cells[cell])
        else:
            await self.cells[cell].resume_engine()
            self.proxy.router.resume(name)

    async def _serve(self, cell: int, client: CellClient) -> None:
        """A replacement starts its engine with the newest weights; the proxy routes
        to it in its predecessor's place."""
        endpoint = await client.start_engine()
        capacity, version = self.config.cells.capacity, self.scheduler.version
        await self.proxy.router.replace(endpoint.client(engine_name(cell), capacity, version))
        self._fresh.discard(cell)

    async def _adopt_replacement(self, cell: int, client: CellClient) -> None:
        """``client``, connected in the place of ``cell``'s dead process, takes its
        role: in rollout it serves (the proxy routes to it again), in training it
        claims micro-steps of the open step once its death is handled (a satellite
        takes the core's weights first), moving it is switched by the move
        (:meth:`_move`). The core's
        replacement holds the boards' weights: those of the run's version (or the next
        one, if the core died in an update after writing them)."""
        if cell == 0:
            version, now = await client.join_training(), self.scheduler.version
            updating = self._step is not None and self._step.updating
            if version not in ((now, now + 1) if updating else (now,)):
                raise RuntimeError(
                    f"the core's replacement took over version {version}, the run is at {now}"
                )
        if self.scheduler.roles[cell] is Role.ROLLOUT:
            await self._serve(cell, client)
        else:
            self._fresh.add(cell)
        self.cells[cell] = client
        self._synced.discard(cell)

    def _rejoin(self) -> None:
        """The training cells claim micro-steps of the open step (again: once the
        groups are re-formed after a death, cells past the dead one take part)."""
        for cell in self._training_prefix():
            self._start_worker(cell)

    def _training_prefix(self) -> list[int]:
        """The training cells that may work on a step: the first of the cells in the
        groups now (:attr:`Supervisor.members`, core first). A colocated pool's cells
        end their moves in any order; each waits for those before it, since a step's
        update reduces over a prefix of the members."""
        training = set(self.scheduler.training_cells)
        prefix: list[int] = []
        for cell in self.supervisor.members:
            if cell not in training or self.supervisor.gone(cell):  # or not heard of yet
                break
            prefix.append(cell)
        return prefix

    async def _publish(self, version: int) -> None:
        """The core's weights reach every rollout engine: the rollout cells and the
        standalone pool (the paper: publication after the burst's final update)."""
        roles = self.scheduler.roles
        lost = self.supervisor.lost
        rollout = [c for c, r in enumerate(roles) if r is Role.ROLLOUT and c not in lost]
        engines: dict[int, EngineClient] = {c: self.cells[c] for c in rollout}
        if self.standalone is not None:
            engines[STANDALONE] = self.standalone
        start = self.now()
        loads = [engine.update_engine_weights() for engine in engines.values()]
        outcomes = await asyncio.gather(*loads, return_exceptions=True)
        for cell, outcome in zip(engines, outcomes, strict=True):
            if isinstance(outcome, ActorDied) and cell != STANDALONE:
                await self.supervisor.lose(cell, outcome)  # it died serving: others took over
            elif isinstance(outcome, BaseException):
                raise outcome
            elif outcome < version:  # its server crashed: started again before it serves
                await self.proxy.router.fail(engine_name(cell))
        self.observer.publication(version, self.now() - start)
        self._emit(lambda t: PublicationDone(t, version))

    # ------------------------------------------------------------------ training

    async def _assign(self, action: AssignGroups) -> None:
        if self._step is None or self._step.step != action.step:
            self.queue.open(action.step)
            self._step = _Step(step=action.step, started_s=self.now())
            self._rejoin()
            self._spawn(self._finish_step(self._step))
        for ms in self.packing.assign(action.step, action.group_ids, action.closes_batch):
            await self.queue.put(ms)
        if action.closes_batch:
            await self.queue.close(self.packing.summary(action.step))

    def _start_worker(self, cell: int) -> None:
        """``cell`` claims micro-steps of the open step; again once micro-steps a cell
        gave back wait and its worker had ended."""
        step = self._step
        if step is None or not step.window_open:
            return
        if cell in step.workers and not step.workers[cell].done():
            return
        step.workers[cell] = self._spawn(self._work(cell, step))
        step.joined.set()

    async def _work(self, cell: int, step: _Step) -> None:
        """A cell in training claims micro-steps until the batch is drained. A cell that
        dies is lost (:meth:`Supervisor.lose`; the core's death stops the run)."""
        try:
            if cell not in self._synced:
                await self.cells[cell].join_training()  # the core's current weights
                self._synced.add(cell)
            while (ms := await self.queue.claim(cell)) is not None:
                self._maybe_pull()  # packing the next group overlaps this micro-step
                call = self.cells[cell].train_micro_step(ms)
                result, seconds = await self.observer.timed(cell, call)
                step.results.append(result)
                step.micro_step_s += seconds
        except ActorDied as died:
            await self.supervisor.lose(cell, died)

    async def _leave_step(self, cell: int) -> None:
        """``cell`` and the cells past it leave the open step, if its update has not
        begun: their workers stop, the micro-steps they claimed go back to the queue
        for the cells that stay (what they computed is dropped: a cell moving to
        rollout discards its gradient), and a satellite takes the core's weights again
        when it rejoins."""
        step = self._step
        if step is None or step.updating:
            return
        for past in sorted(c for c in step.workers if c >= cell):
            worker = step.workers.pop(past)
            if worker is not asyncio.current_task():
                worker.cancel()
            returned = await self.queue.give_back(past)
            step.results = [r for r in step.results if r.cell != past]
            if past != 0:
                self._synced.discard(past)
            log.warning(
                "cell %d left step %d: %d micro-steps go to others", past, step.step, returned
            )

    async def _lost_any(self, step: _Step) -> bool:
        """A cell of ``step`` that died is lost now (it leaves the step), before the
        update's collectives would wait for it; whether one was."""
        for cell in sorted(step.workers):
            try:
                await self.cells[cell].check_alive()
            except ActorDied as died:
                await self.supervisor.lose(cell, died)
                return True
        return False

    def _maybe_pull(self) -> None:
        """Fewer micro-steps wait than cells train: ask for one more ready group."""
        s = self.scheduler
        if not self._pull_queued and s.wants_groups(self.queue.queued):
            self._pull_queued = True
            self._emit(lambda t: PullGroups(t, s.version, 1))

    async def _finish_step(self, step: _Step) -> None:
        while True:
            summary = await self.queue.wait_drained()
            # The update needs a training cell. A batch with nothing to train (no learning
            # signal) drains at once, maybe before any cell of the prefix trains: a
            # colocated pool's core may end its move after the others.
            while not step.workers:
                step.joined.clear()
                await step.joined.wait()
            step.window_open = False  # the joining window closes before the update
            if step.workers:
                await asyncio.wait([*step.workers.values()])
            if not self.queue.drained or await self._lost_any(step):
                # A cell left after the last claim: the others train what it gave back.
                step.window_open = True
                self._rejoin()
                continue
            workers, k = sorted(step.workers), len(step.workers)
            async with self.supervisor.groups:  # no regroup during the update's collectives
                if workers != list(self.supervisor.members[:k]):
                    raise RuntimeError(f"step {step.step}: cells {workers} are not a prefix")
                step.updating = True
                outcomes = await asyncio.gather(
                    *(
                        self.observer.timed(c, self.cells[c].finish_batch(summary, k))
                        for c in workers
                    ),
                    return_exceptions=True,
                )
            done: dict[int, tuple[StepResult, float]] = {
                c: o for c, o in zip(workers, outcomes, strict=True) if isinstance(o, tuple)
            }
            if len(done) == k:
                self._synced = set(workers)
                updates = list(done.values())
                break
            happened = await self._after_a_death_in_update(step, workers, outcomes)
            if happened is not None:  # the core's update, then the satellites'
                self._synced = {0, *done}
                updates = [happened, *(o for c, o in done.items() if c != 0)]
                break
            step.window_open = True  # trained again, from the same weights
            self._rejoin()
        self.trained += list(summary.group_ids)
        launched = {
            g: [v for e in self.scheduler.groups[g].valid if (v := self._launch_version(e)) >= 0]
            for g in summary.group_ids
        }
        version = updates[0][0].version
        self.observer.step(
            step.step,
            step.started_s,
            summary,
            step.results,
            step.micro_step_s,
            updates,
            launched,
        )
        if version % self.config.checkpoint.every == 0 or self.last_step(version):
            await self._checkpoint(version)
        self._step = None
        self._emit(lambda t: StepDone(t, step.step))

    async def _after_a_death_in_update(
        self, step: _Step, workers: list[int], outcomes: Sequence[object]
    ) -> tuple[StepResult, float] | None:
        """An update that failed: the cells that died in it are replaced or lost (a
        failure without a death is raised). The core writes its board before it
        broadcasts, so whoever holds the core's weights now (the core, or its
        replacement) tells whether the update happened: then the core's result (its
        replacement's version, if it died) is returned; else every participant drops
        its gradient, their micro-steps go back on the queue and None is returned."""
        dead: list[tuple[int, ActorDied]] = []
        for cell in workers:
            try:
                await self.cells[cell].check_alive()
            except ActorDied as died:
                dead.append((cell, died))
        if not dead:
            raise next(o for o in outcomes if isinstance(o, BaseException))
        for cell, death in dead:
            await self.supervisor.lose(cell, death)  # the core without a replacement: raises
        step.updating = False
        version = await self.cells[0].join_training()
        if version == step.step + 1:
            core = outcomes[0]
            if isinstance(core, tuple):
                return cast(tuple[StepResult, float], core)
            return StepResult(
                step=step.step, version=version, cells=len(workers), grad_norm=math.nan, seconds=0.0
            ), 0.0
        log.warning("step %d: a cell died in its update; it is trained again", step.step)
        alive = [c for c in workers if c not in self.supervisor.lost]
        await asyncio.gather(*(self.cells[c].discard_gradient() for c in alive))
        self._synced = {0}
        await self._leave_step(0)  # every micro-step back on the queue
        return None

    def _launch_version(self, execution: int) -> int:
        """The version ``execution`` launched at; a resumed ready group's were launched
        by an earlier run (the journal's; -1 when it has none)."""
        ex = self._executions.get(execution)
        return ex.version if ex is not None else self._adoption.versions.get(execution, -1)

    def last_step(self, version: int) -> bool:
        return version >= self.config.run.steps

    async def _checkpoint(self, version: int) -> None:
        """The core writes model, optimizer and what a resumed run needs."""
        state = {
            "version": version,
            "trained_groups": self.trained,
            "next_group": max(self.scheduler.groups, default=-1) + 1,
            "next_execution": max(self.scheduler.executions, default=-1) + 1,
        }
        root, keep = str(self.outputs.checkpoints), self.config.checkpoint.keep
        while True:
            try:
                await self.cells[0].save_checkpoint(root, version, state, keep)
                return
            except ActorDied as died:  # its replacement, if any, writes it
                await self.supervisor.lose(0, died)

    async def shutdown(self, *, keep_harnesses: bool = False) -> None:
        """Stop every execution (their harnesses are killed) and every background task.
        ``keep_harnesses``: stop watching the executions instead, their harnesses left
        running for the resumed run that re-adopts them (the host pool's close)."""
        if not keep_harnesses:
            for ex in self._executions.values():
                await self._cancel(ex)
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            if keep_harnesses or task.get_name() != "execution":
                task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=30)
