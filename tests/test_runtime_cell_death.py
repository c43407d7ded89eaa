"""Cells that die mid-run, with the live controller and scripted cells (no model): a
satellite that dies in a step, and the only rollout cell dying while the core trains.
The run trains every step, and each step's micro-steps are trained exactly once by the
cells that take part in its update (a cell that left gave its claims back)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.test_driver_contract import (
    STEPS,
    Board,
    RecordingScheduler,
    Script,
    ScriptedCell,
    drive,
    script_config,
)

from qwengyre.cluster.client import CellClient
from qwengyre.cluster.local import ActorDied
from qwengyre.config import Config
from qwengyre.runtime import supervisor
from qwengyre.runtime.controller import Controller
from qwengyre.scheduler.core import Scheduler
from qwengyre.scheduler.events import Role
from qwengyre.sim.simulator import SimCosts
from qwengyre.sim.workload import ExecutionSpec
from qwengyre.training.backend import MicroStepResult, StepResult
from qwengyre.training.buffers import BatchSummary, MicroStep


@dataclass(frozen=True)
class Kill:
    """``victim`` dies as cell ``at`` starts its ``nth`` micro-step or a later one, once
    the victim is in role ``victim_in`` with executions running on it (any role, busy or
    not, when None)."""

    victim: int
    at: int
    nth: int = 1
    victim_in: Role | None = None


class Cells:
    """What the scripted cells did: the micro-steps whose gradient each holds or gave
    to an update, the prefix size of each update, who is dead and who dies when."""

    def __init__(self) -> None:
        self.trained: list[tuple[int, int, int]] = []  # (cell, step, micro-step index)
        self.updates: dict[int, int] = {}  # step -> cells in its update
        self.prefixes: dict[int, tuple[int, ...]] = {}  # step -> the cells in its update
        self.dead: set[int] = set()  # cells whose process died (a replacement's may live)
        self.processes: dict[int, MortalCell] = {}  # each cell's newest process
        self.kill: Kill | None = None
        self.crash_server = False  # the next publication to a satellite finds it crashed
        self.crashed: int | None = None  # that satellite
        self.revived: list[int] = []  # cells asked to start their server again
        self.scheduler: Scheduler | None = None  # the run's: roles and loads

    def victim_ready(self, kill: Kill) -> bool:
        if kill.victim_in is None:
            return True
        assert self.scheduler is not None
        role, busy = self.scheduler.roles[kill.victim], self.scheduler.running_on(kill.victim)
        return role is kill.victim_in and bool(busy)

    def die(self, cell: int) -> None:
        """The process of ``cell`` dies now."""
        self.dead.add(cell)
        self.processes[cell].killed = True
        self.drop_open(cell)

    def drop_open(self, cell: int) -> None:
        """``cell``'s gradient of a step not updated yet is gone (it died or left)."""
        self.trained = [t for t in self.trained if t[0] != cell or t[1] in self.updates]


class MortalCell(ScriptedCell):
    """A scripted cell that can die: then every call, and its liveness check, raise."""

    def __init__(self, index: int, costs: SimCosts, board: Board, cells: Cells) -> None:
        super().__init__(index, costs, board)
        self.cells = cells
        self.micro_steps = 0
        self.killed = False
        self.incarnation = 0
        cells.processes[index] = self

    def _alive(self) -> None:
        if self.killed:
            raise ActorDied(f"{self.name} (pid {self.incarnation}) died (exit code -9)")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._alive()
        return await super().call(method, *args, **kwargs)

    async def check_alive(self) -> None:
        self._alive()

    async def train_micro_step(self, ms: MicroStep) -> MicroStepResult:
        self.micro_steps += 1
        kill = self.cells.kill
        due = kill is not None and kill.at == self.index and self.micro_steps >= kill.nth
        if kill is not None and due and self.cells.victim_ready(kill):
            self.cells.kill = None
            self.cells.die(kill.victim)
            self._alive()  # the victim itself dies as it starts the micro-step
        result = await super().train_micro_step(ms)
        self._alive()  # a process that died mid-call answers nothing
        self.cells.trained.append((self.index, ms.step, ms.index))
        return result

    async def update_engine_weights(self) -> int:
        if self.cells.crash_server and self.index != 0:
            self.cells.crash_server, self.cells.crashed = False, self.index
            return self.board.version - 1  # what a server host answers for a dead server
        return await super().update_engine_weights()

    async def revive_engine(self) -> bool:
        self.cells.revived.append(self.index)
        return True

    async def resume_engine(self) -> int:
        self.cells.drop_open(self.index)  # it leaves an open step: its gradient is dropped
        return await super().resume_engine()

    async def finish_batch(self, summary: BatchSummary, cells: int) -> StepResult:
        self.cells.updates[summary.step] = cells
        if self.index == 0:  # the live cells it last re-formed its groups with
            members = getattr(self, "members", range(cells))
            self.cells.prefixes[summary.step] = tuple(members)[:cells]
        return await super().finish_batch(summary, cells)


class Spares:
    """The cluster of scripted cells: a replacement is a new scripted process of the
    dead cell's; ``then`` runs as it starts (another death, say)."""

    def __init__(self, config: Config, board: Board, cells: Cells) -> None:
        self.costs, self.board, self.cells = SimCosts.from_config(config), board, cells
        self.started: list[int] = []
        self.called_off: list[int] = []
        self.then: Callable[[int], Awaitable[None]] | None = None

    async def replacement(self, cell: int) -> CellClient:
        self.started.append(cell)
        if self.then is not None:
            await self.then(cell)
        new = MortalCell(cell, self.costs, self.board, self.cells)
        new.incarnation = len(self.started)
        return CellClient(new)

    def call_off(self, generation: int) -> None:
        self.called_off.append(generation)


async def run(
    config: Config, run_dir: Path, cells: Cells, spares: Spares | None = None
) -> Controller:
    scheduler = RecordingScheduler(config.scheduler_params())
    cells.scheduler = scheduler
    costs = SimCosts.from_config(config)
    board = spares.board if spares is not None else Board()
    count = config.cells.count
    clients = [CellClient(MortalCell(i, costs, board, cells)) for i in range(count)]
    controller = await drive(config, run_dir, scheduler, clients, cluster=spares)
    assert not scheduler.refused
    return controller


def check_every_micro_step_trained_once(cells: Cells, controller: Controller) -> None:
    """Each step's micro-steps were trained once, all by cells of its update's prefix
    (of the live cells)."""
    by_step = Counter((step, index) for _, step, index in cells.trained)
    assert set(by_step.values()) == {1}, by_step
    for cell, step, _ in cells.trained:
        assert cell in cells.prefixes[step], (cell, step, cells.prefixes)
    assert sorted(cells.updates) == list(range(STEPS))
    trained = controller.trained
    assert len(trained) == len(set(trained)) == STEPS * 2


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "CELL_WATCH_S", 0.002)


def left(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " left step " in r.getMessage()]


def test_a_satellite_that_dies_mid_step_gives_its_micro_steps_to_the_cells_that_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = script_config("elastic").model_copy(deep=True)
    config.sim.train_tokens_per_cell_s = 2000  # micro-steps of ~30 ms: cells overlap
    cells = Cells()
    cells.kill = Kill(victim=1, at=1, nth=2)  # at its second micro-step: it holds one

    controller = asyncio.run(run(config, tmp_path, cells))
    assert cells.dead == {1} and set(controller.supervisor.lost) == {1}
    assert controller.scheduler.roles[1] is Role.LOST
    check_every_micro_step_trained_once(cells, controller)
    # The step it died in: the core, and cell 2 (which left too) once the groups were
    # re-formed without cell 1.
    assert cells.prefixes[1] in ((0,), (0, 2)), cells.prefixes
    assert any(p == (0, 2) for p in cells.prefixes.values()), cells.prefixes  # it trains on
    assert left(caplog)[0] == "cell 1 left step 1: 1 micro-steps go to others"


def test_the_only_rollout_cell_dying_brings_the_core_back_from_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    execution = Script.execution

    def slow(self: Script, query_id: int, index: int) -> ExecutionSpec:
        spec = execution(self, query_id, index)  # 10-40 ms: 0.2-0.8 s, so that some run
        return dataclasses.replace(spec, duration_s=spec.duration_s * 20)  # while it trains

    monkeypatch.setattr(Script, "execution", slow)
    config = script_config("elastic").model_copy(deep=True)
    config.cells.count = 2
    config.sim.train_tokens_per_cell_s = 500  # micro-steps of ~100 ms: a death is seen mid-step
    cells = Cells()
    # As the core trains a micro-step while cell 1 serves executions alone.
    cells.kill = Kill(victim=1, at=0, victim_in=Role.ROLLOUT)
    controller = asyncio.run(run(config, tmp_path, cells))
    assert set(controller.supervisor.lost) == {1} and cells.kill is None
    check_every_micro_step_trained_once(cells, controller)
    assert any(m.startswith("cell 0 left step ") for m in left(caplog)), left(caplog)


def test_a_publication_that_finds_a_server_crashed_has_it_revived(tmp_path: Path) -> None:
    cells = Cells()
    cells.crash_server = True
    # async: the satellites serve rollout for good and get every publication
    controller = asyncio.run(run(script_config("async"), tmp_path, cells))
    assert cells.crashed is not None and cells.crashed in cells.revived  # drained, revived
    assert not controller.supervisor.lost
    # Taken back as it was started again: this proxy has no periodic health check.
    assert controller.proxy.router.failed() == []


def test_the_core_dying_while_a_satellite_is_replaced_is_replaced_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deaths that overlap: cell 2 dies serving rollout, and the core dies while cell
    2's replacement starts. One formation of the groups takes both replacements in
    (none is formed with a dead member); the run trains every step on."""
    config = script_config("elastic").model_copy(deep=True)
    config.run.replace_dead_cells = 2
    cells = Cells()
    cells.kill = Kill(victim=2, at=0, victim_in=Role.ROLLOUT)
    board = Board()
    spares = Spares(config, board, cells)

    async def the_core_dies(cell: int) -> None:
        if cell == 2:
            cells.die(0)
            await asyncio.sleep(0.05)  # seen by the supervisor's watch meanwhile

    spares.then = the_core_dies
    controller = asyncio.run(run(config, tmp_path, cells, spares))
    assert cells.dead == {0, 2} and spares.started == [2, 0]
    assert controller.supervisor.replaced == 2 and not controller.supervisor.lost
    assert [controller.cells[c].handle for c in (0, 2)] == [cells.processes[c] for c in (0, 2)]
    check_every_micro_step_trained_once(cells, controller)
    took_place = [r.getMessage() for r in caplog.records if "takes its place" in r.getMessage()]
    assert [m.split(";")[0] for m in took_place] == [
        "cell-2 (pid 0) died (exit code -9)",
        "cell-0 (pid 0) died (exit code -9)",
    ]
