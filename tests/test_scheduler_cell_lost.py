"""A rollout cell lost for good (:class:`CellLost`): the run goes on with the others."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tests.params import make_params
from tests.test_scheduler_properties import scheduler_params
from tests.test_scheduler_rules import finish, of

from qwengyre.scheduler.core import Scheduler, SchedulerError, SchedulerParams
from qwengyre.scheduler.events import (
    STANDALONE,
    AssignGroups,
    Cancel,
    CellLost,
    CellMoved,
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
from qwengyre.types import Outcome


def three_cells(**kw: object) -> Scheduler:
    params: dict = dict(
        batch=2, group_size=1, mu=1, phi=1, cells=3, cell_capacity=2, rho_min=0.5, tau_s=0
    )
    params.update(kw)
    return Scheduler(make_params(**params))


def test_a_lost_rollout_cell_hands_its_executions_on_and_the_cells_past_it_train_on():
    s = three_cells()
    out = s.handle(Start(0.0))  # four groups of one: 0-1 on cell 2, 2-3 on cell 1
    assert [a.engine for a in of(Launch, out)] == [2, 2, 1, 1]
    out = s.handle(CellLost(1.0, 1))
    assert of(Reroute, out) == [Reroute(2, 1, 0), Reroute(3, 1, 0)]  # the one with room
    assert s.roles == [Role.ROLLOUT, Role.LOST, Role.ROLLOUT] and s.capacity == 4
    assert s.units == [(0,), (2,)]  # training stays a prefix of the live cells
    finish(s, 2.0, 0)  # a ready group; w = 3 > 2, the room cell 2 leaves the core
    out = finish(s, 3.0, 1)  # w = 2 <= 2: the core joins (Eq 5 counts cell 2's room)
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING)]
    assert of(Reroute, out) == [Reroute(2, 0, 2), Reroute(3, 0, 2)]
    s.handle(CellMoved(4.0, 0))
    s.handle(PullGroups(4.0, 0, 2))
    finish(s, 5.0, 2)
    out = finish(s, 5.5, 3)  # rollout done: cell 2, past the lost cell, joins the core
    assert of(MoveCell, out) == [MoveCell(2, Role.TRAINING)]
    s.handle(CellMoved(6.0, 2))
    assert s.training_cells == (0, 2)
    assert not any(a.engine == 1 for a in of(Launch, s.handle(StepDone(7.0, 0))))


def two_training_one_serving() -> Scheduler:
    """Cells 0 and 1 train (step 0 open), cell 2 serves executions 2 and 3."""
    s = three_cells()
    s.handle(Start(0.0))  # executions 0-1 on cell 2, 2-3 on cell 1
    finish(s, 1.0, 0)
    s.handle(CellMoved(2.0, 0))
    s.handle(PullGroups(2.0, 0, 1))
    assert of(MoveCell, finish(s, 3.0, 1)) == [MoveCell(1, Role.TRAINING)]  # 2-3 to cell 2
    s.handle(CellMoved(4.0, 1))
    assert s.training_cells == (0, 1) and s.running_on(2) == frozenset({2, 3})
    return s


def test_the_last_rollout_cell_lost_brings_the_newest_satellite_back_to_serve_its_executions():
    s = two_training_one_serving()
    out = s.handle(CellLost(5.0, 2))
    assert out == [MoveCell(1, Role.ROLLOUT)]  # the newest in training; nothing serves yet
    assert s.running_on(2) == frozenset() and s.counters.running == 2  # parked, not lost
    out = s.handle(CellMoved(6.0, 1))
    assert of(Reroute, out) == [Reroute(2, 2, 1), Reroute(3, 2, 1)]
    assert s.training_cells == (0,) and s.units == [(0,), (1,)]
    assert not of(MoveCell, finish(s, 7.0, 2))  # a later join must wait for Eq 5 again


def test_the_last_rollout_cell_lost_with_only_the_core_training_brings_the_core_back():
    s = three_cells(cells=2, phi=0, cell_capacity=1)  # two groups: cell 1 and cell 0
    s.handle(Start(0.0))
    assert of(MoveCell, finish(s, 1.0, 0)) == [MoveCell(0, Role.TRAINING)]  # 1 to cell 1
    s.handle(CellMoved(2.0, 0))
    assert s.handle(CellLost(3.0, 1)) == [MoveCell(0, Role.ROLLOUT)]
    assert of(Reroute, s.handle(CellMoved(4.0, 0))) == [Reroute(1, 1, 0)]
    assert s.units == [(0,)]
    out = finish(s, 5.0, 1)  # rollout done (w = 0): the core alone trains, as a pool would
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING)]


def test_a_cell_lost_while_moving_to_training_returns_the_core_after_its_own_move():
    s = three_cells(cells=2, phi=0, cell_capacity=1)
    s.handle(Start(0.0))
    finish(s, 1.0, 0)  # the core is on its way to training; cell 1 is the only engine
    assert s.handle(CellLost(2.0, 1)) == []  # ordered back: it finishes its move first
    assert s.handle(CellMoved(3.0, 0)) == [MoveCell(0, Role.ROLLOUT)]
    assert of(Reroute, s.handle(CellMoved(4.0, 0))) == [Reroute(1, 1, 0)]


def test_with_a_standalone_pool_the_last_rollout_cell_goes_and_no_cell_returns():
    s = three_cells(cells=2, phi=0, cell_capacity=1, standalone_capacity=1)
    out = s.handle(Start(0.0))
    assert [a.engine for a in of(Launch, out)] == [STANDALONE, 1]
    finish(s, 1.0, 0)
    assert s.roles[0] is Role.TO_TRAINING
    out = s.handle(CellLost(2.0, 1))
    assert out == [Reroute(1, 1, STANDALONE)]  # over its capacity until 1 ends
    assert s.handle(CellMoved(3.0, 0)) == []  # the core trains on


def test_a_satellite_lost_in_training_leaves_the_prefix_and_the_cells_past_it_stay():
    s = two_training_one_serving()
    s.handle(CellLost(5.0, 1))
    assert s.training_cells == (0,) and s.units == [(0,), (2,)]
    pool = three_cells(standalone_capacity=8)  # everything runs on the pool: all join
    pool.handle(Start(0.0))
    finish(pool, 1.0, 0)
    for t, cell in enumerate(range(3), start=2):
        pool.handle(CellMoved(float(t), cell))
    assert pool.training_cells == (0, 1, 2)
    assert pool.handle(CellLost(5.0, 1)) == []  # cell 2 trains on: a prefix of the live cells
    assert pool.training_cells == (0, 2) and pool.units == [(0,), (2,)]


def test_the_core_a_lost_cell_and_a_loss_that_could_never_train_again_are_refused():
    s = three_cells(cells=2, phi=0, cell_capacity=1)
    s.handle(Start(0.0))
    with pytest.raises(SchedulerError, match=r"cell 0 \(rollout\) cannot be lost"):
        s.handle(CellLost(1.0, 0))
    async_run = Scheduler(make_params(policy="async", cells=3, async_training_cells=1))
    async_run.handle(Start(0.0))
    async_run.handle(CellLost(1.0, 2))
    with pytest.raises(SchedulerError, match=r"cell 2 \(lost\) cannot be lost"):
        async_run.handle(CellLost(2.0, 2))
    with pytest.raises(SchedulerError, match="under async the core trains for good"):
        async_run.handle(CellLost(2.0, 1))
    params = dict(cells=3, dispatch="continuous", phi=0, mu=1, batch=1, group_size=2)
    continuous = Scheduler(make_params(**params, oversample=0, cell_capacity=1))
    continuous.handle(Start(0.0))  # 2 outstanding: they fit on cells 1 and 2, not on one
    with pytest.raises(SchedulerError, match="continuous dispatch keeps 2 executions"):
        continuous.handle(CellLost(1.0, 2))


def test_async_whose_rollout_cell_is_lost_gives_up_a_training_cell_for_good():
    s = Scheduler(make_params(policy="async", cells=3, async_training_cells=2))
    s.handle(Start(0.0))
    assert s.handle(CellLost(1.0, 2)) == [MoveCell(1, Role.ROLLOUT)]
    s.handle(CellMoved(2.0, 1))
    assert s.roles == [Role.TRAINING, Role.ROLLOUT, Role.LOST]
    assert s.capacity == s.params.cell_capacity


def test_colocate_moves_only_the_cells_before_the_lost_one_and_counts_the_rest_as_room():
    s = three_cells(policy="colocate", phi=0, cell_capacity=1)  # two groups: cells 2 and 1
    out = s.handle(Start(0.0))
    assert [a.engine for a in of(Launch, out)] == [2, 1]
    s.handle(CellLost(1.0, 2))
    assert s.units == [(0, 1)]
    out = finish(s, 2.0, 1)  # w = 1 <= the room of no cell: the pool waits
    assert not of(MoveCell, out)
    out = finish(s, 3.0, 0)  # rollout done: cells 0 and 1 switch, not 2 (lost)
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING), MoveCell(1, Role.TRAINING)]


# ---------------------------------------------------------------- any run, any loss


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=scheduler_params(), data=st.data())
def test_after_any_loss_nothing_reaches_the_lost_cell_training_stays_before_it_and_steps_go_on(
    params: SchedulerParams, data: st.DataObject
):
    """A random legal run with every reward valid; at a random point some of the cells
    the scheduler may let go are lost, one after another. Every action keeps off the
    lost cells, no unit holds one (under async training ends before the first of
    them), and the run trains 4 more steps."""
    s = Scheduler(params)
    running: set[int] = set()
    cancelled: set[int] = set()  # still running until reported
    moving: list[int] = []
    publish: list[int] = []
    wakes: list[float] = []
    closed = False
    lost: set[int] = set()
    now = 0.0

    def absorb(actions: list) -> None:
        nonlocal closed
        first_lost = min(lost, default=params.cells)
        for a in actions:
            match a:
                case Launch():
                    assert a.engine not in lost
                    running.add(a.execution_id)
                case Cancel():
                    cancelled.add(a.execution_id)
                case Reroute():
                    assert a.destination not in lost and a.execution_id in running
                case MoveCell():
                    assert a.cell not in lost
                    moving.append(a.cell)
                    if a.role is Role.TRAINING and params.policy == "async":
                        assert a.cell < first_lost, (a, lost)
                case Publish():
                    publish.append(a.version)
                case AssignGroups():
                    closed = a.closes_batch
                case WakeAt():
                    wakes.append(a.time)
        if params.policy == "async":
            assert all(c < first_lost for c in s.training_cells)
        else:  # the live cells past a lost one train on (the runtime re-forms the groups)
            assert not set(s.training_cells) & lost
            assert all(set(unit).isdisjoint(lost) for unit in s.units)
        assert all(s.roles[c] is Role.LOST for c in lost)

    absorb(s.handle(Start(now)))
    lose_after = data.draw(st.integers(0, 60), label="lose after")
    target, handled = None, 0
    while target is None or s.version < target:
        handled += 1
        assert handled < 5000, f"no progress: version {s.version}, roles {s.roles}"
        if target is None and handled >= lose_after:
            losable = [c for c in range(params.cells) if s.why_not_lose(c) is None]
            chosen = (
                data.draw(st.lists(st.sampled_from(losable), unique=True), "lose")
                if losable
                else []
            )
            for cell in chosen:
                if s.why_not_lose(cell) is None:  # one loss may keep the next from being one
                    lost.add(cell)
                    moving[:] = [c for c in moving if c != cell]  # its switch never ends
                    absorb(s.handle(CellLost(now, cell)))
            event(f"cells lost: {len(lost)}")
            target = s.version + 4
            continue
        choices = ["finish"] * bool(running) + ["move"] * bool(moving)
        choices += ["publish"] * bool(publish) + ["step"] * closed
        choices += ["pull"] * bool(s.training_cells and s.batch_needs) + ["wake"] * bool(wakes)
        if not choices:
            now += 1.0
            absorb(s.handle(Tick(now)))
            continue
        now += 0.1
        move = data.draw(st.sampled_from(choices), label="move")
        if move == "finish":
            eid = data.draw(st.sampled_from(sorted(running)), label="execution")
            running.discard(eid)
            if eid in cancelled:
                absorb(s.handle(ExecutionFinished(now, eid, Outcome.CANCELLED, None)))
            else:
                absorb(s.handle(ExecutionFinished(now, eid, Outcome.COMPLETED, 1.0)))
        elif move == "move":
            absorb(s.handle(CellMoved(now, moving.pop(0))))
        elif move == "publish":
            absorb(s.handle(PublicationDone(now, publish.pop(0))))
        elif move == "step":
            closed = False
            absorb(s.handle(StepDone(now, s.version)))
        elif move == "pull":
            absorb(s.handle(PullGroups(now, s.version, s.batch_needs)))
        else:
            now = max(now, min(wakes))
            wakes[:] = [w for w in wakes if w > now]
            absorb(s.handle(Tick(now)))
    trained = [c.group_id for c in s.consumed()]
    assert len(trained) == len(set(trained))
