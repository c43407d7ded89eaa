"""One scripted workload through both drivers of the scheduler: the simulator (virtual
clock) and the live controller (real clock; its cells, harness host and proxy are
stubs that take the script's times).

Each driver drives a :class:`RecordingScheduler`, which logs every event it handles
with the actions it answered. From the logs, every driver must keep the scheduler's
contract (docs/architecture.md, "The scheduler's contract"): each ``Launch`` answered by
exactly one ``ExecutionFinished``, each ``Cancel`` by one whose outcome is
``cancelled``, each ``MoveCell`` by its ``CellMoved``, each ``Publish`` by its
``PublicationDone``, each ``WakeAt`` by a ``Tick`` no earlier, ``PullGroups`` only for
the open step, ``StepDone`` only for a closed batch, and no event the scheduler refuses.
And the two drivers must agree on everything the script fixes whatever the timing: the
steps done, the groups each burst trained, the groups and the staleness of each step,
the rewards and the executions of every trained group.

The script (boundary dispatch, mu = 2, phi = 0, B = 2 groups of N = 2 with one surplus
execution each) makes those timing-free: each boundary dispatches the 2 B groups its
burst trains, all at the same version, and a group's surplus execution never ends by
itself, so it is always the one cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from qwengyre.cluster.client import CellClient
from qwengyre.cluster.placement import engine_name
from qwengyre.config import Config, load_config
from qwengyre.presets import preset_path
from qwengyre.proxy.routing import Router
from qwengyre.records.assessments import AssessmentLog
from qwengyre.records.metrics import MetricsWriter
from qwengyre.records.trace import TraceWriter
from qwengyre.rollout.execution import ExecutionResult
from qwengyre.rollout.harness import HarnessSpec
from qwengyre.rollout.hosts import ExecutionRequest, HostPool
from qwengyre.rollout.tasks import CommandEvaluator, Task
from qwengyre.runtime.controller import Controller, RunOutputs
from qwengyre.runtime.journal import LaunchJournal
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.runtime.supervisor import Cluster
from qwengyre.scheduler.core import Scheduler, SchedulerError, SchedulerParams
from qwengyre.scheduler.events import (
    Action,
    AssignGroups,
    Cancel,
    CellMoved,
    Dispatch,
    Event,
    ExecutionFinished,
    Launch,
    MoveCell,
    PublicationDone,
    Publish,
    PullGroups,
    Start,
    StepDone,
    Tick,
    WakeAt,
)
from qwengyre.sim.simulator import SimCosts, Simulation
from qwengyre.sim.workload import ExecutionSpec
from qwengyre.training.backend import MicroStepResult, StepResult
from qwengyre.training.buffers import BatchSummary, MicroStep
from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree
from qwengyre.types import Outcome

STEPS, MU, BATCH, GROUP = 4, 2, 2, 2
SURPLUS_S = 1e6
"""The surplus execution's duration: it is cancelled long before."""
PROMPT_TOKENS = 8


def script_config(policy: str, *overrides: str) -> Config:
    """The run: every time in it (cell moves, micro-steps, updates, publications) is a
    few milliseconds, as are the executions' (:class:`Script`); then ``overrides``."""
    return load_config(
        preset_path("embedded"),
        [
            f"run.steps={STEPS}",
            f"sim.steps={STEPS}",
            "cells.count=3",
            "cells.capacity=6",
            "cells.rollout_to_training_s=0.006",
            "cells.training_to_rollout_s=0.004",
            f"groups.size={GROUP}",
            f"groups.batch={BATCH}",
            "groups.oversample=1",
            "groups.min_valid=null",
            f"scheduler.policy={policy}",
            "scheduler.dispatch=boundary",
            "scheduler.target_staleness=null",
            f"scheduler.mu={MU}",
            "scheduler.phi=0",
            "scheduler.rho_min=0.5",
            "scheduler.tau_s=0.005",
            "trainer.micro_step_tokens=128",
            "sim.micro_step_tokens=128",
            "sim.train_tokens_per_cell_s=20000",
            "sim.train_step_overhead_s=0.005",
            "sim.publish_s=0.01",
            *overrides,
        ],
    )


class Script:
    """The workload both drivers run (the simulator's :class:`Workload`): execution
    ``index`` of group ``query_id`` takes 10-40 ms and earns 0 or 1 (each group gets
    both); the surplus one (index N) would run for :data:`SURPLUS_S`."""

    name = "script"

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        surplus = index >= GROUP
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=SURPLUS_S if surplus else 0.01 * (1 + (query_id + index) % 4),
            outcome=Outcome.COMPLETED,
            reward=float((query_id + index) % 2),
            train_tokens=40 + 8 * index,
        )


class RecordingScheduler(Scheduler):
    """The scheduler, logging each event it handles with the actions it answered, and
    each event it refused."""

    def __init__(self, params: SchedulerParams) -> None:
        super().__init__(params)
        self.log: list[tuple[Event, list[Action]]] = []
        self.refused: list[tuple[Event, SchedulerError]] = []
        self.launches: list[Launch] = []  # in the order issued

    def handle(self, event: Event) -> list[Action]:
        try:
            actions = super().handle(event)
        except SchedulerError as error:
            self.refused.append((event, error))
            raise
        self.log.append((event, list(actions)))
        self.launches += [a for a in actions if isinstance(a, Launch)]
        return actions


@dataclass
class DriverRun:
    """What a driver left: the scheduler it drove, and the events it had produced but
    not delivered when its run was over (the live controller's queue after shutdown)."""

    scheduler: RecordingScheduler
    undelivered: list[Event] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)  # group ids, as the cells trained them


# ---------------------------------------------------------------- the simulator


def simulate(config: Config) -> DriverRun:
    params = config.scheduler_params()
    scheduler = RecordingScheduler(params)
    costs = SimCosts.from_config(config)
    Simulation(params, costs, Script(), config.sim.steps, scheduler=scheduler).run()
    return DriverRun(scheduler)


# ---------------------------------------------------------------- the live controller


@dataclass
class Board:
    """The core's newest weights, as the cells see them: their version."""

    version: int = 0


class ScriptedCell:
    """A cell's actor (the transport behind a :class:`CellClient`) without a model:
    each call takes the time ``costs`` give it and answers what a real cell would."""

    def __init__(self, index: int, costs: SimCosts, board: Board) -> None:
        self.name = engine_name(index)
        self.index = index
        self.costs = costs
        self.board = board

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self, method)(*args, **kwargs)

    async def check_alive(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def release_engine(self) -> str:
        await asyncio.sleep(self.costs.rollout_to_training_s)
        return "released"

    async def resume_engine(self) -> int:
        await asyncio.sleep(self.costs.training_to_rollout_s)
        return self.board.version

    async def join_training(self) -> int:
        return self.board.version

    async def update_engine_weights(self) -> int:
        await asyncio.sleep(self.costs.publish_s)
        return self.board.version

    async def train_micro_step(self, ms: MicroStep) -> MicroStepResult:
        seconds = self.costs.micro_step_s(ms.num_tokens)
        await asyncio.sleep(seconds)
        return MicroStepResult(
            step=ms.step,
            index=ms.index,
            cell=self.index,
            tokens=ms.num_tokens,
            targets=ms.num_targets,
            loss=0.0,
            clipped=0,
            executions=len(ms.execution_ids),
            seconds=seconds,
        )

    async def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        await asyncio.sleep(self.costs.train_step_overhead_s)
        version = summary.step + 1
        if self.index == 0:  # the core's update is the one the other cells take
            self.board.version = version
        return StepResult(
            step=summary.step,
            version=version,
            cells=cells,
            grad_norm=1.0,
            seconds=self.costs.train_step_overhead_s,
        )

    async def save_checkpoint(self, root: str, step: int, state: object, keep: int) -> str:
        return f"{root}/{step:06d}"

    async def regroup(self, members: Sequence[int], generation: int) -> None:
        self.members = tuple(members)  # the live cells it re-formed its groups with

    async def pid(self) -> int:
        return 0

    async def connect(self, members: Sequence[int], generation: int, takeover: bool) -> int:
        await self.regroup(members, generation)  # a replacement's: it joins the groups
        return 0

    async def start_engine(self) -> IdleEndpoint:
        return IdleEndpoint()  # a replacement's engine, in its predecessor's place

    async def discard_gradient(self) -> None:
        pass


@dataclass(frozen=True)
class IdleEngine:
    """An engine the router can route to; no call ever reaches it."""

    name: str
    capacity: int

    async def health(self) -> bool:
        return True


class IdleEndpoint:
    """A scripted cell's engine, as its host starts it."""

    def client(self, name: str, capacity: int, version: int) -> IdleEngine:
        return IdleEngine(name, capacity)


class ScriptedProxy:
    """What the controller uses of the proxy: executions, their trees, the router.

    The controller creates one execution per ``Launch``, in the order the scheduler
    issued them, so the k-th it creates is the one of ``launches[k]``."""

    def __init__(self, config: Config, launches: Sequence[Launch]) -> None:
        self.router = Router()
        for cell in range(config.cells.count):
            self.router.register(IdleEngine(engine_name(cell), config.cells.capacity), cell)
        self.launches = launches
        self.launch_of: dict[str, Launch] = {}
        self.trees: dict[str, TrajectoryTree] = {}

    async def create_execution(self) -> dict[str, str]:
        execution_id = f"ex_{len(self.launch_of)}"
        self.launch_of[execution_id] = self.launches[len(self.launch_of)]
        self.trees[execution_id] = TrajectoryTree()
        url = f"http://proxy.invalid/x/{execution_id}"
        return {"id": execution_id, "key": "key", "base_url": url, "openai_base_url": url}

    async def revoke_execution(self, execution_id: str) -> None:
        self.router.forget(execution_id)

    async def tree(self, execution_id: str) -> TrajectoryTree:
        return self.trees[execution_id]

    def model_call(self, execution_id: str, tokens: int, version: int) -> None:
        """The execution's one model call: a prompt and ``tokens`` sampled tokens."""
        now = time.time()
        usage = {"input_tokens": PROMPT_TOKENS, "output_tokens": tokens}
        engine = self.router.route_of(execution_id) or ""
        meta = NodeMeta(
            request_class="main.task",
            agent_id="main",
            engine=engine,
            policy_version=version,
            started_s=now,
            finished_s=now,
            finish_reason="stop",
            usage=usage,
        )
        tree = self.trees[execution_id]
        tree.add(None, [1] * PROMPT_TOKENS, [2] * tokens, [-1.0] * tokens, [version] * tokens, meta)


class ScriptedHost:
    """A harness host whose executions take the script's time and end with its
    reward, after one model call; a cancelled one ends at once, ``cancelled``."""

    name = "scripted"

    def __init__(self, proxy: ScriptedProxy, capacity: int) -> None:
        self.proxy = proxy
        self.capacity = capacity
        self.script = Script()
        self._cancels: dict[str, asyncio.Event] = {}

    async def run(self, request: ExecutionRequest) -> ExecutionResult:
        execution_id = request.execution_id
        launch = self.proxy.launch_of[execution_id]
        spec = self.script.execution(launch.group_id, launch.index)
        cancel = self._cancels[execution_id] = asyncio.Event()
        started = time.monotonic()
        try:
            await asyncio.wait_for(cancel.wait(), spec.duration_s)
            outcome, reward = Outcome.CANCELLED, None
        except TimeoutError:
            self.proxy.model_call(execution_id, spec.train_tokens, launch.version)
            outcome, reward = spec.outcome, spec.reward
        finally:
            del self._cancels[execution_id]
        task = request.task.id
        return ExecutionResult(
            execution_id=execution_id,
            task_id=task,
            outcome=outcome,
            reward=reward,
            started_s=started,
            ended_s=time.monotonic(),
            harness=None,
            host=self.name,
        )

    async def cancel(self, execution_id: str) -> None:
        if execution_id in self._cancels:
            self._cancels[execution_id].set()


TASKS = [
    Task(id=f"t{i}", instructions="-", evaluator=CommandEvaluator(command=["true"]))
    for i in range(3)
]


async def drive(
    config: Config,
    run_dir: Path,
    scheduler: RecordingScheduler,
    cells: list[CellClient],
    cluster: Cluster | None = None,
) -> Controller:
    """The live controller's run of ``scheduler`` over scripted ``cells`` (replaced by
    ``cluster``'s), the proxy and the harness host scripted too; the controller, once
    shut down."""
    proxy = ScriptedProxy(config, scheduler.launches)
    hosts = HostPool([ScriptedHost(proxy, capacity=config.cells.count * config.cells.capacity)])
    outputs = RunOutputs(
        run_dir=run_dir,
        metrics=MetricsWriter(run_dir / "metrics.jsonl"),
        traces=TraceWriter(run_dir / "traces.jsonl"),
        ledger=Ledger(run_dir / LEDGER_DIR),
        assessments=AssessmentLog(run_dir / "assessments.jsonl"),
        journal=LaunchJournal(run_dir / "launches.jsonl"),
    )
    harness = HarnessSpec(command=("true",), deadline_s=60.0)  # the host starts none
    controller = Controller(
        config, scheduler, proxy, cells, TASKS, harness, outputs, hosts=hosts, cluster=cluster
    )
    try:
        await controller.run(Start(0.0))
    finally:
        await controller.shutdown()  # the executions still running end cancelled
        outputs.metrics.close()
        outputs.traces.close()
    return controller


async def run_live(config: Config, run_dir: Path) -> DriverRun:
    scheduler = RecordingScheduler(config.scheduler_params())
    costs, board = SimCosts.from_config(config), Board()
    cells = [CellClient(ScriptedCell(i, costs, board)) for i in range(config.cells.count)]
    controller = await drive(config, run_dir, scheduler, cells)
    # The Ticks asked for come at their times, after the run or not.
    wakes = [a.time for _, actions in scheduler.log for a in actions if isinstance(a, WakeAt)]
    await asyncio.sleep(max([0.0, *(t - controller.now() for t in wakes)]) + 0.001)
    undelivered = []
    while not controller.events.empty():
        undelivered.append(controller.events.get_nowait())
    assert board.version == STEPS  # the core updated once a step
    return DriverRun(scheduler, undelivered, list(controller.trained))


# ---------------------------------------------------------------- the contract


def check_contract(run: DriverRun, steps: int) -> list[Action]:
    """The driver kept the scheduler's contract (module docstring) up to the run's last
    step; the actions it left unanswered.

    Every answer (in the log, or among the events left undelivered) answers an action
    that waits for it. A ``Launch``, ``Cancel`` or ``Publish`` issued before the last
    step was done is answered, and so is a ``WakeAt`` whose time came before. A cell may
    still be moving when the run is over (the simulator stops at its last step, the
    controller's shutdown stops a move)."""
    log = run.scheduler.log
    assert not run.scheduler.refused
    end = next(i for i, (e, _) in enumerate(log) if isinstance(e, StepDone) and e.step == steps - 1)
    end_time = log[end][0].time
    # What waits for its answer, with where it was issued (its index in the log).
    launched: dict[int, tuple[int, Action]] = {}  # by execution
    moving: dict[int, tuple[int, Action]] = {}  # by cell
    publishing: dict[int, tuple[int, Action]] = {}  # by version
    waking: list[tuple[int, WakeAt]] = []
    finished: set[int] = set()
    cancelled: set[int] = set()
    closed: set[int] = set()  # steps whose batch closed
    done = 0  # steps done
    delivered = [(e, a) for e, a in log] + [(e, []) for e in run.undelivered]
    for i, (event, actions) in enumerate(delivered):
        match event:
            case ExecutionFinished(execution_id=eid):
                assert launched.pop(eid, None) is not None, f"{event}: no Launch waits for it"
                finished.add(eid)
                if eid in cancelled:
                    assert event.outcome is Outcome.CANCELLED and event.reward is None, event
            case CellMoved(cell=cell):
                assert moving.pop(cell, None) is not None, f"{event}: no MoveCell waits for it"
            case PublicationDone(version=version):
                assert publishing.pop(version, None) is not None, f"{event}: no Publish"
            case Tick(time=now):
                waking = [(where, wake) for where, wake in waking if wake.time > now]
            case StepDone(step=step):
                assert step == done and step in closed, f"{event}: its batch is not closed"
                done += 1
            case PullGroups(step=step) if i < len(log):
                assert step == done, f"{event} while step {done} is open"
        for action in actions:
            match action:
                case Launch(execution_id=eid):
                    assert eid not in launched and eid not in finished, action
                    launched[eid] = (i, action)
                case Cancel(execution_id=eid):
                    assert eid in launched, f"{action}: not running"
                    cancelled.add(eid)
                case MoveCell(cell=cell):
                    assert cell not in moving, f"{action}: cell {cell} is moving"
                    moving[cell] = (i, action)
                case Publish(version=version):
                    publishing[version] = (i, action)
                case WakeAt():
                    waking.append((i, action))
                case AssignGroups(step=step, closes_batch=True):
                    closed.add(step)
    assert done == steps and run.scheduler.version == steps
    left = [*launched.values(), *moving.values(), *publishing.values(), *waking]
    due = [
        action
        for where, action in left
        if where < end
        and not isinstance(action, MoveCell)
        and not (isinstance(action, WakeAt) and action.time >= end_time)
    ]
    assert not due, f"never answered: {due}"
    return [action for _, action in left]


# ---------------------------------------------------------------- timing-free outcomes


@dataclass(frozen=True)
class TimingFree:
    """What the script fixes, whichever driver ran it and however fast."""

    bursts: list[frozenset[int]]  # the groups each burst of mu steps trained
    staleness: list[tuple[int, ...]]  # per step, v_t - v_d of its groups, sorted
    rewards: dict[int, dict[int, float]]  # per trained group: index -> valid reward
    executions: dict[int, tuple[int, int]]  # per trained group: (launched, cancelled)


def timing_free(log: Sequence[tuple[Event, Sequence[Action]]], steps: int) -> TimingFree:
    actions = [a for _, answered in log for a in answered]
    v_d = {a.group_id: a.version for a in actions if isinstance(a, Dispatch) and not a.topup}
    steps_groups: list[list[int]] = [[] for _ in range(steps)]
    for a in actions:
        if isinstance(a, AssignGroups):
            steps_groups[a.step] += a.group_ids
    trained = [g for groups in steps_groups for g in groups]
    assert len(trained) == len(set(trained)), f"a group trained twice: {steps_groups}"
    assert [len(groups) for groups in steps_groups] == [BATCH] * steps
    launch = {a.execution_id: a for a in actions if isinstance(a, Launch)}
    cancels = {a.execution_id for a in actions if isinstance(a, Cancel)}
    ended = [e for e, _ in log if isinstance(e, ExecutionFinished)]
    return TimingFree(
        bursts=[
            frozenset(g for groups in steps_groups[b : b + MU] for g in groups)
            for b in range(0, steps, MU)
        ],
        staleness=[tuple(sorted(s - v_d[g] for g in steps_groups[s])) for s in range(steps)],
        rewards={
            g: {
                launch[e.execution_id].index: e.reward
                for e in ended
                if launch[e.execution_id].group_id == g and e.reward is not None
            }
            for g in trained
        },
        executions={
            g: (
                sum(a.group_id == g for a in launch.values()),
                sum(launch[e].group_id == g for e in cancels),
            )
            for g in trained
        },
    )


def expected(steps: int) -> TimingFree:
    script = Script()
    groups = range(steps * BATCH)
    return TimingFree(
        bursts=[frozenset(range(b * BATCH, (b + MU) * BATCH)) for b in range(0, steps, MU)],
        staleness=[(s % MU,) * BATCH for s in range(steps)],
        rewards={g: {i: script.execution(g, i).reward for i in range(GROUP)} for g in groups},
        executions={g: (GROUP + 1, 1) for g in groups},
    )


@pytest.mark.parametrize("policy", ["elastic", "async", "colocate"])
def test_both_drivers_keep_the_contract_and_agree(policy: str, tmp_path: Path) -> None:
    config = script_config(policy)
    runs = {"sim": simulate(config), "live": asyncio.run(run_live(config, tmp_path))}
    for driver, run in runs.items():
        unanswered = check_contract(run, STEPS)
        if driver == "live":  # it ends after the last publication, and stops what runs
            assert all(isinstance(a, MoveCell) for a in unanswered), unanswered
        kinds = {type(a) for _, actions in run.scheduler.log for a in actions}
        assert {Launch, Cancel, Publish} <= kinds, driver
        assert (MoveCell in kinds) == (policy != "async"), driver
        assert WakeAt in kinds or policy != "elastic", driver  # the supply check's tau
    sim, live = (timing_free(runs[d].scheduler.log, STEPS) for d in ("sim", "live"))
    assert sim == live == expected(STEPS)
    assigned = [
        g
        for _, actions in runs["live"].scheduler.log
        for a in actions
        if isinstance(a, AssignGroups)
        for g in a.group_ids
    ]
    assert runs["live"].trained == assigned  # the cells trained what was assigned, in order


class LateCore(ScriptedCell):
    """A scripted cell; the core (cell 0) ends its move to training well after the rest."""

    async def release_engine(self) -> str:
        if self.index == 0:
            await asyncio.sleep(0.2)
        return await super().release_engine()


def test_a_batch_with_nothing_to_train_is_updated_once_the_late_core_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reward 0: no batch packs a micro-step, so each drains at once. A colocated
    pool assigns it as soon as a cell trains; its update must wait for the core, which
    ends its move last (it ran with no cell: IndexError)."""
    scripted = Script.execution
    monkeypatch.setattr(
        Script,
        "execution",
        lambda self, q, i: dataclasses.replace(scripted(self, q, i), reward=0.0),
    )
    config = script_config("colocate", "scheduler.streaming=false")
    scheduler = RecordingScheduler(config.scheduler_params())
    costs, board = SimCosts.from_config(config), Board()
    cells = [CellClient(LateCore(i, costs, board)) for i in range(config.cells.count)]
    controller = asyncio.run(drive(config, tmp_path, scheduler, cells))
    assert board.version == STEPS  # the core updated once a step
    assert len(controller.trained) == STEPS * BATCH
