"""Each scheduler rule on small, hand-computed cases (docs/design.md §2, Eqs 1-6)."""

from __future__ import annotations

import pytest
from tests.params import make_params

from qwengyre.scheduler.core import (
    GroupState,
    InFlightExecution,
    InFlightGroup,
    ReadyGroup,
    Scheduler,
    SchedulerError,
)
from qwengyre.scheduler.events import (
    STANDALONE,
    Adopt,
    AssignGroups,
    Cancel,
    CellMoved,
    Dispatch,
    DropGroup,
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
from qwengyre.scheduler.staleness import BurstShape, burst_for_staleness, predicted_staleness
from qwengyre.types import Outcome


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def finish(s: Scheduler, t: float, eid: int, reward: float | None = 1.0) -> list:
    outcome = Outcome.COMPLETED if reward is not None else Outcome.OVERALL_TIMEOUT
    return s.handle(ExecutionFinished(t, eid, outcome, reward))


# ---------------------------------------------------------------- Eq 2


@pytest.mark.parametrize(
    ("policy", "target", "shape"),
    [
        ("async", 1.5, BurstShape(1, 1.5)),
        ("colocate", 1.5, BurstShape(4, 0.0)),
        ("elastic", 1.5, BurstShape(3, 0.5)),
        ("async", 1.0, BurstShape(1, 1.0)),
        ("colocate", 1.0, BurstShape(3, 0.0)),
        ("elastic", 1.0, BurstShape(2, 0.5)),
        ("elastic", 0.5, BurstShape(1, 0.5)),
        ("elastic", 0.25, BurstShape(1, 0.25)),
        ("elastic", 0.0, BurstShape(1, 0.0)),
        ("elastic", 2.0, BurstShape(3, 1.0)),
        ("elastic", 2.5, BurstShape(3, 1.5)),
    ],
)
def test_burst_for_staleness_matches_the_paper(policy: str, target: float, shape: BurstShape):
    got = burst_for_staleness(policy, target)
    assert got == shape
    assert predicted_staleness(got.mu, got.phi) == pytest.approx(target)


def test_burst_for_staleness_refuses_impossible_targets():
    with pytest.raises(ValueError, match=r"multiple of 0\.5"):
        burst_for_staleness("colocate", 1.2)
    with pytest.raises(ValueError, match=">= 0"):
        burst_for_staleness("elastic", -1)
    with pytest.raises(ValueError, match="allowed: elastic, async, colocate"):
        burst_for_staleness("fifo", 1)


# ---------------------------------------------------------------- Eqs 1, 3, 4


def test_initial_dispatch_fills_the_queue_depth_and_launches_up_to_capacity():
    p = make_params(
        batch=4, group_size=2, mu=2, phi=0.5, cells=2, cell_capacity=3, standalone_capacity=1
    )
    s = Scheduler(p)
    out = s.handle(Start(0.0))
    assert p.queue_depth == 10  # Eq 1: (0.5 + 2) * 4 groups
    assert len(of(Dispatch, out)) == 10
    assert s.counters.dispatched == 20  # N executions each
    launches = of(Launch, out)
    assert len(launches) == 7  # Eq 3/4: C = 2 * 3 + 1
    # Standalone first, then cells in descending index (they stay in rollout longest).
    assert [a.engine for a in launches] == [STANDALONE, 1, 1, 1, 0, 0, 0]
    assert s.counters.queued == 13 and s.counters.running == 7
    assert all(d.version == 0 for d in of(Dispatch, out))


def test_a_termination_frees_one_slot_for_one_launch():
    s = Scheduler(make_params(batch=2, group_size=2, cells=1, cell_capacity=2))
    s.handle(Start(0.0))
    assert s.counters.running == 2 and s.counters.queued == 2
    out = finish(s, 1.0, 0)
    assert [a.execution_id for a in of(Launch, out)] == [2]
    assert s.counters == type(s.counters)(dispatched=4, launched=3, finished=1)
    assert s.counters.waterlevel == 3


# ---------------------------------------------------------------- groups


def test_oversampling_cancels_the_surplus_and_counts_each_launch_once():
    s = Scheduler(make_params(batch=1, group_size=2, oversample=1, cells=1, cell_capacity=8))
    s.handle(Start(0.0))
    assert s.counters.dispatched == 3 and s.counters.running == 3
    finish(s, 1.0, 0, 0.0)
    out = finish(s, 2.0, 1, 1.0)
    assert of(Cancel, out) == [Cancel(2)]
    group = s.groups[0]
    assert group.state is GroupState.READY and group.valid == {0: 0.0, 1: 1.0}
    assert s.counters.finished == 2  # cancelled, not yet terminated
    s.handle(ExecutionFinished(2.5, 2, Outcome.CANCELLED, None))
    assert s.counters.finished == 3 and s.counters.running == 0
    with pytest.raises(SchedulerError, match="finished twice"):
        s.handle(ExecutionFinished(3.0, 2, Outcome.CANCELLED, None))


def test_a_missing_reward_is_never_a_zero_it_is_topped_up():
    """With a replacement reserve the top-up launches at once, ahead of the queue."""
    s = Scheduler(
        make_params(batch=2, group_size=2, max_topups=1, cells=1, cell_capacity=2, reserve=1)
    )
    s.handle(Start(0.0))  # group 0 = executions 0,1 (running); group 1 = 2,3 (queued)
    out = finish(s, 1.0, 0, None)
    (topup,) = of(Dispatch, out)
    assert topup == Dispatch(0, (4,), 0, topup=True)
    # The top-up jumps the queue: it launches before group 1's executions.
    assert of(Launch, out) == [Launch(4, 0, 2, 0, version=0)]
    assert s.groups[0].valid == {} and s.groups[0].state is GroupState.ROLLOUT
    finish(s, 2.0, 1, 0.0)
    finish(s, 3.0, 4, 0.0)
    assert s.groups[0].valid == {1: 0.0, 4: 0.0}  # real zeros, and only real ones
    assert s.groups[0].state is GroupState.READY


def test_with_min_valid_a_finished_group_trains_on_its_valid_rewards_only():
    s = Scheduler(make_params(batch=1, group_size=3, min_valid=2, cells=1, cell_capacity=3))
    s.handle(Start(0.0))
    finish(s, 1.0, 0, 1.0)
    out = finish(s, 2.0, 1, None)  # 1 valid + 1 pending can still reach min_valid: wait
    assert not of(Dispatch, out) and s.groups[0].state is GroupState.ROLLOUT
    finish(s, 3.0, 2, 0.0)
    assert s.groups[0].state is GroupState.READY
    assert s.groups[0].valid == {0: 1.0, 2: 0.0}  # the missing reward is not a zero


def test_below_min_valid_the_group_owes_a_top_up_to_the_next_boundary():
    """Boundary dispatch keeps d fixed within a burst (the paper): a short group's top-up
    is owed, and the burst trains the other groups meanwhile."""
    s = Scheduler(make_params(batch=1, group_size=3, min_valid=2, phi=1, cells=1, cell_capacity=6))
    s.handle(Start(0.0))  # group 0 = executions 0-2, group 1 = 3-5, all running
    finish(s, 1.0, 0, None)
    d = s.counters.dispatched
    out = finish(s, 2.0, 1, None)  # 0 valid + 1 pending < 2: one top-up, owed
    assert not of(Dispatch, out) and s.counters.dispatched == d
    assert s.groups[0].owed == 1


def test_owed_top_ups_are_dispatched_at_the_next_boundary_with_the_new_version():
    s = Scheduler(make_params(batch=1, group_size=2, max_topups=2, phi=1, cells=2, cell_capacity=4))
    s.handle(Start(0.0))  # groups 0, 1 (executions 0-3) on cell 1
    w = s.counters.waterlevel
    out = finish(s, 1.0, 0, None)  # group 0 falls short by one
    assert not of(Dispatch, out) and s.counters.waterlevel == w - 1
    finish(s, 1.0, 1, 1.0)
    finish(s, 2.0, 2, 1.0)
    out = finish(s, 2.0, 3, 0.0)  # group 1 ready; w = 0: the core joins (tau 30)
    s.handle(Tick(40.0))
    s.handle(CellMoved(41.0, 0))
    out = s.handle(PullGroups(41.0, 0, 1))
    assert of(AssignGroups, out) == [AssignGroups(0, (1,), closes_batch=True)]
    assert of(Publish, s.handle(StepDone(42.0, 0))) == [Publish(1)]
    out = s.handle(PublicationDone(43.0, 1))
    # The owed top-up comes first, at the new version; then Eq 1 refills group 1's slot.
    dispatches = of(Dispatch, out)
    assert dispatches[0] == Dispatch(0, (4,), 1, topup=True)
    assert [(d.group_id, d.version, d.topup) for d in dispatches[1:]] == [(2, 1, False)]
    assert s.groups[0].owed == 0
    assert of(Launch, out)[0] == Launch(4, 0, 2, 1, version=1)  # first, on cell 1
    assert s.executions[4].version == 1
    assert s.groups[0].v_d == 0  # its staleness stays v_t - v_d (Eq 2)


def test_a_group_past_its_topup_allowance_is_dropped_at_once_and_refilled_at_the_boundary():
    s = Scheduler(
        make_params(batch=1, group_size=2, max_topups=0, cells=2, cell_capacity=4, phi=1, tau_s=0)
    )
    s.handle(Start(0.0))  # groups 0 and 1, executions 0..3, all on cell 1
    out = finish(s, 1.0, 0, None)
    assert of(DropGroup, out) == [DropGroup(0)]
    assert of(Cancel, out) == [Cancel(1)]
    assert not of(Dispatch, out)  # the slot waits for the boundary: d stays fixed
    assert s.groups[0].state is GroupState.DROPPED
    assert s.counters.waterlevel == 3  # 1 finished, nothing new dispatched
    s.handle(ExecutionFinished(1.0, 1, Outcome.CANCELLED, None))
    finish(s, 2.0, 2)
    finish(s, 2.0, 3)  # group 1 ready, w = 0: the core joins
    s.handle(CellMoved(3.0, 0))
    s.handle(PullGroups(3.0, 0, 1))
    s.handle(StepDone(4.0, 0))
    out = s.handle(PublicationDone(5.0, 1))
    # Eq 1: Q = 2 slots, both free (group 0 dropped, group 1 trained).
    assert [(d.group_id, d.version) for d in of(Dispatch, out)] == [(2, 1), (3, 1)]


def test_colocate_trains_the_other_groups_while_a_short_group_waits():
    """min_valid, one group whose executions all fail: the pool no longer waits for
    serial top-up rounds. It switches when the rest is done, trains the other groups,
    and the burst ends early (it cannot fill its last step); the short group's top-ups
    run after the publication and it is trained in a later batch."""
    s = Scheduler(
        make_params(
            policy="colocate",
            batch=1,
            group_size=2,
            min_valid=1,
            mu=2,
            cells=2,
            cell_capacity=4,
            tau_s=0,
        )
    )
    s.handle(Start(0.0))  # groups 0, 1: executions 0-3 on cell 1
    finish(s, 1.0, 0, None)
    out = finish(s, 2.0, 1, None)  # group 0 short: its top-up is owed
    assert not of(Dispatch, out) and s.groups[0].owed == 1
    finish(s, 3.0, 2, 1.0)
    out = finish(s, 3.0, 3, 0.0)  # w = 0: the whole pool switches
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING), MoveCell(1, Role.TRAINING)]
    s.handle(CellMoved(4.0, 0))
    s.handle(CellMoved(4.0, 1))
    assert of(AssignGroups, s.handle(PullGroups(4.0, 0, 1))) == [
        AssignGroups(0, (1,), closes_batch=True)
    ]
    out = s.handle(StepDone(5.0, 0))  # step 1 cannot be filled: the burst ends early
    assert of(Publish, out) == [Publish(1)]
    out = s.handle(PublicationDone(6.0, 1))
    assert [(d.group_id, d.version, d.topup) for d in of(Dispatch, out)] == [
        (0, 1, True),
        (2, 1, False),
    ]
    assert of(MoveCell, out) == [MoveCell(0, Role.ROLLOUT), MoveCell(1, Role.ROLLOUT)]


def test_a_burst_that_cannot_fill_its_first_step_dispatches_owed_top_ups_at_once():
    """phi = 0 leaves no extra group: a short group in the burst's first step would wait
    forever for a boundary, so its top-up is dispatched at once (d and w rise)."""
    s = Scheduler(make_params(batch=2, group_size=2, max_topups=1, cells=1, cell_capacity=2))
    s.handle(Start(0.0))  # group 0 = executions 0,1 (running); group 1 = 2,3 (queued)
    w = s.counters.waterlevel
    out = finish(s, 1.0, 0, None)
    assert of(Dispatch, out) == [Dispatch(0, (4,), 0, topup=True)]
    assert s.counters.waterlevel == w  # one finished, one dispatched


def test_the_reserve_launches_top_ups_at_once_and_counts_in_the_waterlevel():
    s = Scheduler(
        make_params(batch=1, group_size=2, max_topups=2, phi=1, cells=1, cell_capacity=8, reserve=1)
    )
    s.handle(Start(0.0))  # 4 executions running
    c = s.counters
    assert (c.dispatched, c.finished, c.reserved, c.waterlevel) == (4, 0, 1, 5)
    out = finish(s, 1.0, 0, None)  # the top-up comes out of the reserve
    assert of(Dispatch, out) == [Dispatch(0, (4,), 0, topup=True)]
    c = s.counters
    assert (c.dispatched, c.finished, c.reserved, c.waterlevel) == (5, 1, 0, 4)
    assert s._reserve_left == 0
    out = finish(s, 2.0, 4, None)  # the reserve is spent: owed to the boundary
    assert not of(Dispatch, out) and s.groups[0].owed == 1
    for eid in (1, 2, 3):
        finish(s, 3.0, eid)
    assert s.counters.waterlevel == 0  # rollout is over: nothing held


def test_continuous_dispatch_tops_up_and_replaces_at_once():
    s = Scheduler(
        make_params(
            policy="async",
            dispatch="continuous",
            batch=1,
            group_size=2,
            max_topups=1,
            cells=2,
            cell_capacity=8,
            async_training_cells=1,
        )
    )
    s.handle(Start(0.0))  # group 0: executions 0, 1
    assert of(Dispatch, finish(s, 1.0, 0, None)) == [Dispatch(0, (2,), 0, topup=True)]
    out = finish(s, 2.0, 2, None)  # past the allowance: dropped and replaced at once
    assert of(DropGroup, out) == [DropGroup(0)]
    assert [(d.group_id, d.topup) for d in of(Dispatch, out)] == [(1, False)]
    with pytest.raises(ValueError, match=r"groups\.reserve"):
        make_params(dispatch="continuous", policy="async", phi=0, reserve=1)


# ---------------------------------------------------------------- Eq 5, supply check, Eq 6


def two_cell_elastic(**kw) -> Scheduler:
    params = dict(
        batch=2, group_size=2, mu=1, phi=1, cells=2, cell_capacity=4, rho_min=0.5, tau_s=10
    )
    params.update(kw)
    return Scheduler(make_params(**params))


def test_a_cell_joins_when_eq5_and_the_supply_check_have_held_for_tau():
    s = two_cell_elastic()
    out = s.handle(Start(0.0))  # 4 groups of 2; executions 0-3 on cell 1, 4-7 on cell 0
    assert [a.engine for a in of(Launch, out)] == [1, 1, 1, 1, 0, 0, 0, 0]
    finish(s, 1.0, 0)
    out = finish(s, 1.0, 1)  # group 0 ready: supply 1 >= 0.5 * 2, but w = 6 > C_e = 4
    assert s.ready_unassigned == 1 and not of(MoveCell, out) and not of(WakeAt, out)
    finish(s, 2.0, 2)
    out = finish(s, 2.0, 3)  # w = 4 <= (2 - 0 - 1) * 4; supply held since t=1
    assert of(WakeAt, out) == [WakeAt(11.0)] and not of(MoveCell, out)
    out = s.handle(Tick(11.0))
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING)]
    # Cell 0 stops accepting: its four running executions move to cell 1.
    assert of(Reroute, out) == [Reroute(e, 0, 1) for e in (4, 5, 6, 7)]
    assert s.roles == [Role.TO_TRAINING, Role.ROLLOUT] and s.capacity == 4
    assert s.running_on(1) == frozenset({4, 5, 6, 7})
    assert s.handle(CellMoved(19.0, 0)) == []  # training, but nobody pulled yet
    out = s.handle(PullGroups(19.0, 0, 2))
    assert of(AssignGroups, out) == [AssignGroups(0, (0, 1), closes_batch=True)]
    # Satellite 1 cannot join: w = 4 > capacity with two cells training (0).
    assert not of(MoveCell, s.handle(Tick(40.0)))
    out = s.handle(StepDone(50.0, 0))
    assert of(Publish, out) == [Publish(1)]
    out = s.handle(PublicationDone(51.0, 1))
    # Boundary refill: the two consumed slots come back at the new version (Eq 1).
    assert [(d.group_id, d.version) for d in of(Dispatch, out)] == [(4, 1), (5, 1)]
    # Eq 6: nothing ready for the next batch, so the core returns to rollout.
    assert of(MoveCell, out) == [MoveCell(0, Role.ROLLOUT)]
    assert not of(Launch, out)  # cell 1 is full, cell 0 is still switching
    out = s.handle(CellMoved(55.0, 0))
    assert [a.engine for a in of(Launch, out)] == [0, 0, 0, 0]
    assert [(g.group_id, g.v_d, g.v_t, g.staleness) for g in s.consumed()] == [
        (0, 0, 0, 0),
        (1, 0, 0, 0),
    ]


def test_the_supply_timer_resets_when_the_check_lapses():
    """The paper's supply count (ready, unassigned): a group the buffer takes stops counting."""
    s = two_cell_elastic(cells=3, cell_capacity=8, mu=2, phi=0, supply="ready")
    s.handle(Start(0.0))
    finish(s, 1.0, 0)
    out = finish(s, 1.0, 1)  # group 0 ready: supply 1 >= 0.5 * 2
    assert of(WakeAt, out) == [WakeAt(11.0)]
    assert of(MoveCell, s.handle(Tick(11.0))) == [MoveCell(0, Role.TRAINING)]
    out = s.handle(CellMoved(20.0, 0))  # the timer restarts after the transition
    assert of(WakeAt, out) == [WakeAt(30.0)]
    s.handle(PullGroups(22.0, 0, 1))  # the buffer takes group 0: the check lapses
    finish(s, 25.0, 2)
    finish(s, 25.0, 3)  # group 1 ready: the check holds again, from t=25
    out = s.handle(Tick(30.0))
    assert not of(MoveCell, out) and of(WakeAt, out) == [WakeAt(35.0)]
    assert of(MoveCell, s.handle(Tick(35.0))) == [MoveCell(1, Role.TRAINING)]


def test_groups_in_hand_keep_the_supply_check_while_the_core_trains_them():
    """supply="in_hand" (the default) counts the batch's assigned groups too: taking a
    group into training does not lapse the check, so the satellite that will share its
    micro-steps joins tau after the core's transition."""
    s = two_cell_elastic(cells=3, cell_capacity=8, mu=2, phi=0)  # 8 executions on cell 2
    s.handle(Start(0.0))
    finish(s, 1.0, 0)
    finish(s, 1.0, 1)
    assert of(MoveCell, s.handle(Tick(11.0))) == [MoveCell(0, Role.TRAINING)]
    assert of(WakeAt, s.handle(CellMoved(20.0, 0))) == [WakeAt(30.0)]
    s.handle(PullGroups(22.0, 0, 1))  # group 0 assigned: still in hand
    assert s.ready_unassigned == 0
    assert of(MoveCell, s.handle(Tick(30.0))) == [MoveCell(1, Role.TRAINING)]


def test_the_buffer_pulls_only_what_the_training_cells_can_use():
    s = two_cell_elastic(cells=3, cell_capacity=8, mu=2, phi=0, tau_s=0.5)
    s.handle(Start(0.0))  # 4 groups of 2, all on cell 2
    for eid in range(4):
        finish(s, 1.0, eid)  # groups 0 and 1 ready
    assert of(MoveCell, s.handle(Tick(1.5))) == [MoveCell(0, Role.TRAINING)]
    assert not s.wants_groups(0)  # nobody trains yet
    s.handle(CellMoved(2.0, 0))
    assert s.wants_groups(0)
    out = s.handle(PullGroups(2.0, 0, 1))
    assert of(AssignGroups, out) == [AssignGroups(0, (0,), closes_batch=False)]
    assert not s.wants_groups(1)  # group 0's micro-step waits for the one training cell
    # Group 1 stays ready and unassigned: the supply that lets cell 1 join after tau.
    assert of(MoveCell, s.handle(Tick(2.5))) == [MoveCell(1, Role.TRAINING)]
    s.handle(CellMoved(3.0, 1))
    assert s.wants_groups(1) and not s.wants_groups(2)  # two cells train now
    s.handle(PullGroups(3.0, 0, 1))
    assert s.batch_needs == 0 and not s.wants_groups(0)  # the batch is complete


def test_satellites_join_in_prefix_order_and_return_at_the_end_of_the_burst():
    s = Scheduler(
        make_params(
            batch=2, group_size=1, mu=1, phi=0, cells=3, cell_capacity=2, rho_min=0.5, tau_s=0
        )
    )
    s.handle(Start(0.0))  # two groups of one execution, both on cell 2
    out = finish(s, 1.0, 0)
    assert of(MoveCell, out) == [MoveCell(0, Role.TRAINING)]
    # Serially: cell 1 waits for the core's transition; then Eq 5 holds (w = 1 <= 2).
    out = s.handle(CellMoved(2.0, 0))
    assert of(MoveCell, out) == [MoveCell(1, Role.TRAINING)]
    s.handle(CellMoved(3.0, 1))
    out = finish(s, 4.0, 1)
    assert of(MoveCell, out) == [MoveCell(2, Role.TRAINING)]
    s.handle(CellMoved(5.0, 2))
    assert s.training_cells == (0, 1, 2)
    s.handle(PullGroups(5.0, 0, 2))
    out = s.handle(StepDone(6.0, 0))
    assert of(MoveCell, out) == [MoveCell(1, Role.ROLLOUT), MoveCell(2, Role.ROLLOUT)]
    assert of(Publish, out) == [Publish(1)]
    assert s.roles == [Role.TRAINING, Role.TO_ROLLOUT, Role.TO_ROLLOUT]


def test_a_satellite_whose_burst_ends_mid_switch_finishes_the_switch_then_returns():
    s = Scheduler(
        make_params(
            batch=2, group_size=1, mu=1, phi=0, cells=3, cell_capacity=2, rho_min=0.5, tau_s=0
        )
    )
    s.handle(Start(0.0))
    finish(s, 1.0, 0)
    assert of(MoveCell, s.handle(CellMoved(2.0, 0))) == [MoveCell(1, Role.TRAINING)]
    s.handle(PullGroups(2.0, 0, 2))
    out = finish(s, 2.5, 1)
    assert of(AssignGroups, out) == [AssignGroups(0, (1,), closes_batch=True)]
    out = s.handle(StepDone(3.0, 0))  # cell 1 is still switching to training
    assert of(Publish, out) == [Publish(1)] and not of(MoveCell, out)
    assert s.roles[1] is Role.TO_TRAINING
    assert of(MoveCell, s.handle(CellMoved(4.0, 1))) == [MoveCell(1, Role.ROLLOUT)]
    s.handle(CellMoved(5.0, 1))
    assert s.roles[1] is Role.ROLLOUT


def test_the_core_stays_in_training_when_eq6_holds():
    s = Scheduler(
        make_params(
            batch=1, group_size=1, mu=1, phi=1, cells=2, cell_capacity=4, rho_min=1, tau_s=0
        )
    )
    s.handle(Start(0.0))  # 2 groups, 2 executions on cell 1
    finish(s, 1.0, 0)
    s.handle(CellMoved(2.0, 0))
    s.handle(PullGroups(2.0, 0, 1))
    finish(s, 3.0, 1)  # group 1 ready for the next batch
    s.handle(StepDone(4.0, 0))
    out = s.handle(PublicationDone(5.0, 1))
    # ready 1 >= rho_min * B and w + mu N B = 1 <= (K - 1) C_e: the core stays.
    assert not of(MoveCell, out) and s.roles[0] is Role.TRAINING
    assert of(AssignGroups, s.handle(PullGroups(5.0, 1, 1))) == [
        AssignGroups(1, (1,), closes_batch=True)
    ]


# ---------------------------------------------------------------- policies


def test_colocate_moves_the_whole_pool_only_when_rollout_is_done():
    s = Scheduler(
        make_params(policy="colocate", batch=2, group_size=1, cells=3, cell_capacity=1, tau_s=0)
    )
    s.handle(Start(0.0))
    assert not of(MoveCell, finish(s, 1.0, 0))  # w = 1 > C_s = 0
    out = finish(s, 2.0, 1)
    assert of(MoveCell, out) == [MoveCell(c, Role.TRAINING) for c in (0, 1, 2)]
    for c in range(3):
        s.handle(CellMoved(3.0, c))
    s.handle(PullGroups(3.0, 0, 2))
    out = s.handle(StepDone(4.0, 0))
    assert of(Publish, out) == [Publish(1)] and not of(MoveCell, out)
    out = s.handle(PublicationDone(5.0, 1))
    assert of(MoveCell, out) == [MoveCell(c, Role.ROLLOUT) for c in (0, 1, 2)]
    assert s.core_kept == 0  # nothing ready: Eq 6 sends the pool back


def test_colocate_with_a_standalone_pool_switches_while_extra_groups_run_there():
    """The paper's C1: extra dispatch keeps harnesses running on the standalone pool
    while the whole colocated pool trains."""
    s = Scheduler(
        make_params(
            policy="colocate",
            batch=1,
            group_size=1,
            cells=2,
            cell_capacity=1,
            standalone_capacity=1,
            phi=1,
            tau_s=0,
        )
    )
    out = s.handle(Start(0.0))
    assert [a.engine for a in of(Launch, out)] == [STANDALONE, 1]
    out = finish(s, 1.0, 0)  # w = 1 <= C_s = 1: the pool switches, execution 1 moves
    assert of(MoveCell, out) == [MoveCell(c, Role.TRAINING) for c in (0, 1)]
    assert of(Reroute, out) == [Reroute(1, 1, STANDALONE)]
    for c in range(2):
        s.handle(CellMoved(2.0, c))
    s.handle(PullGroups(2.0, 0, 1))
    assert of(Publish, s.handle(StepDone(3.0, 0))) == [Publish(1)]
    finish(s, 3.5, 1)  # the extra group finished on the standalone pool meanwhile
    out = s.handle(PublicationDone(4.0, 1))
    assert of(Dispatch, out) == [Dispatch(2, (2,), 1)]  # one slot freed: Q = 2 groups
    assert of(MoveCell, out) == []  # a ready group and w = 1 <= C_s: Eq 6 keeps the pool
    assert s.training_cells == (0, 1) and s.core_kept == 1


def test_async_keeps_a_fixed_split():
    s = Scheduler(
        make_params(
            policy="async",
            batch=1,
            group_size=1,
            cells=3,
            cell_capacity=2,
            async_training_cells=1,
            phi=1,
        )
    )
    out = s.handle(Start(0.0))
    assert s.training_cells == (0,) and s.capacity == 4
    assert [a.engine for a in of(Launch, out)] == [2, 2]  # cell 0 never rolls out
    finish(s, 1.0, 0)
    assert of(AssignGroups, s.handle(PullGroups(1.0, 0, 1))) == [
        AssignGroups(0, (0,), closes_batch=True)
    ]
    out = s.handle(StepDone(2.0, 0))
    assert of(Publish, out) == [Publish(1)] and not of(MoveCell, out)
    out = s.handle(PublicationDone(3.0, 1))
    assert [d.version for d in of(Dispatch, out)] == [1] and not of(MoveCell, out)


def test_without_streaming_the_batch_is_assigned_whole():
    s = Scheduler(
        make_params(
            policy="async",
            batch=2,
            group_size=1,
            cells=2,
            cell_capacity=4,
            async_training_cells=1,
            streaming=False,
        )
    )
    s.handle(Start(0.0))
    finish(s, 1.0, 0)
    assert not of(AssignGroups, s.handle(PullGroups(1.0, 0, 1)))
    out = finish(s, 2.0, 1)
    assert of(AssignGroups, out) == [AssignGroups(0, (0, 1), closes_batch=True)]


def test_continuous_dispatch_replaces_a_group_as_soon_as_it_is_ready():
    s = Scheduler(
        make_params(
            policy="async",
            dispatch="continuous",
            batch=1,
            group_size=1,
            cells=2,
            cell_capacity=4,
            async_training_cells=1,
        )
    )
    s.handle(Start(0.0))
    out = finish(s, 1.0, 0)
    assert [(d.group_id, d.version) for d in of(Dispatch, out)] == [(1, 0)]


# ---------------------------------------------------------------- bad events


def test_events_that_contradict_the_state_are_refused_and_change_nothing():
    s = Scheduler(make_params(batch=1, group_size=1, cells=1, cell_capacity=1))
    with pytest.raises(SchedulerError, match="before Start"):
        s.handle(Tick(0.0))
    s.handle(Start(1.0))
    before = s.counters
    with pytest.raises(SchedulerError, match="never launched"):
        finish(s, 2.0, 99)
    with pytest.raises(SchedulerError, match="StepDone"):
        s.handle(StepDone(2.0, 0))
    with pytest.raises(SchedulerError, match="not in transition"):
        s.handle(CellMoved(2.0, 0))
    with pytest.raises(SchedulerError, match="before"):
        s.handle(Tick(0.5))
    with pytest.raises(SchedulerError, match="cancelled execution cannot carry a reward"):
        s.handle(ExecutionFinished(2.0, 0, Outcome.CANCELLED, 1.0))
    assert s.counters == before


def test_params_refuse_inconsistent_policies():
    with pytest.raises(ValueError, match=r"colocate needs a standalone pool \(cells\.standalone"):
        make_params(policy="colocate", phi=1)
    with pytest.raises(ValueError, match="colocate needs dispatch boundary"):
        make_params(policy="colocate", dispatch="continuous")
    with pytest.raises(ValueError, match=r"scheduler\.supply='some'; allowed: in_hand, ready"):
        make_params(supply="some")
    # Continuous dispatch keeps Q (N + o) executions outstanding: 2 * 4 > (2 - 1) * 6.
    with pytest.raises(ValueError, match="no cell could ever train"):
        make_params(dispatch="continuous", batch=2, group_size=4, cells=2, cell_capacity=6)
    make_params(dispatch="continuous", batch=2, group_size=4, cells=2, cell_capacity=8)
    with pytest.raises(ValueError, match="async_training_cells=8"):
        make_params(policy="async", cells=8, async_training_cells=8)
    with pytest.raises(ValueError, match="allowed: boundary, continuous"):
        make_params(dispatch="eager")


def test_a_resumed_scheduler_trains_the_ready_groups_first_and_never_reuses_ids():
    s = Scheduler(
        make_params(
            policy="async",
            batch=2,
            group_size=1,
            cells=2,
            cell_capacity=2,
            async_training_cells=1,
            phi=1,
        )
    )
    s.resume(3, [ReadyGroup(id=7, v_d=2), ReadyGroup(id=4, v_d=3)], next_group=9, next_execution=20)
    out = s.handle(Start(10.0))
    assert s.version == 3 and s.published == 3
    # Boundary dispatch: the two ready groups hold their slots; the rest refills.
    dispatched = of(Dispatch, out)
    assert [d.group_id for d in dispatched] == [9, 10]  # depth (1 + 1) * 2, two held
    assert [d.execution_ids for d in dispatched] == [(20,), (21,)]
    assert all(d.version == 3 for d in dispatched)
    assigned = of(AssignGroups, s.handle(PullGroups(11.0, 3, 2)))
    assert assigned == [AssignGroups(3, (7, 4), closes_batch=True)]  # oldest v_d first
    with pytest.raises(SchedulerError, match="before Start"):
        s.resume(0, [], next_group=50, next_execution=50)
    with pytest.raises(SchedulerError, match="below next_group"):
        Scheduler(s.params).resume(0, [ReadyGroup(id=5, v_d=0)], next_group=5, next_execution=0)


def test_a_resumed_scheduler_adopts_running_executions_and_replaces_lost_ones():
    """In-flight groups come back: running executions are adopted (never launched
    again), finished ones keep their rewards, lost ones are replaced by top-ups outside
    the max_topups allowance, and new ids start past the old run's."""
    s = Scheduler(
        make_params(
            policy="elastic",
            batch=2,
            group_size=3,
            oversample=0,
            max_topups=0,
            cells=2,
            cell_capacity=4,
            phi=0,
            mu=1,
            reserve=0,
        )
    )
    running = InFlightExecution(id=11, index=1, version=2, running=True)
    group = InFlightGroup(
        id=5,
        v_d=2,
        executions=(
            InFlightExecution(id=10, index=0, version=2, finished=True, reward=1.0),
            running,
            InFlightExecution(id=12, index=2, version=2),  # lost with the driver
        ),
    )
    done = InFlightGroup(  # everything counted before the restart: ready at once
        id=6,
        v_d=2,
        executions=tuple(
            InFlightExecution(id=13 + i, index=i, version=2, finished=True, reward=0.5)
            for i in range(3)
        ),
    )
    s.resume(3, [], next_group=7, next_execution=16, in_flight=[group, done])
    out = s.handle(Start(0.0))
    adopted = of(Adopt, out)
    assert adopted == [Adopt(11, 5, 1, adopted[0].engine, 2)]
    launched = of(Launch, out)
    assert 11 not in [launch.execution_id for launch in launched]  # never started twice
    topup = [d for d in of(Dispatch, out) if d.group_id == 5]
    assert topup == [Dispatch(5, (16,), 3, topup=True)]  # the replacement, a new id
    assert s.groups[6].state is GroupState.READY
    assert s.counters.running == len(launched) + 1
    s.handle(ExecutionFinished(1.0, 11, Outcome.COMPLETED, 0.0))
    s.handle(ExecutionFinished(2.0, 16, Outcome.COMPLETED, 1.0))
    assert s.groups[5].state is GroupState.READY
    assert s.groups[5].valid == {10: 1.0, 11: 0.0, 16: 1.0}
    with pytest.raises(SchedulerError, match="below next_execution"):
        Scheduler(s.params).resume(0, [], next_group=9, next_execution=12, in_flight=[group])
