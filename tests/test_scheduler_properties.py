"""Random drivers for the scheduler: docs/design.md §4's invariants after every event.

A :class:`Driver` plays the imperative shell around the pure scheduler. It answers
every action as the contract asks (``Launch`` -> one ``ExecutionFinished``, ``Cancel``
-> a cancelled ``ExecutionFinished``, ``MoveCell`` -> ``CellMoved``, ``Publish`` ->
``PublicationDone``, ``WakeAt`` -> ``Tick``) and pulls and steps training, in whatever
order hypothesis picks among the moves that are legal at that moment. After every
``handle()`` it checks the invariants against its own bookkeeping (an independent
model of the queue, the engines, the groups and the supply timer) and the scheduler's
read-only views.

Boundary dispatch keeps d(t) fixed within a burst: between two boundaries (Start,
PublicationDone) the quota d + reserve left and the waterlevel w = d - f + reserved
never rise, owed top-ups come with the next boundary's dispatch, and a dropped group's
slot waits for it. The one exception, checked against the driver's own count of the
groups that can still fill the step, is a stalled burst (see ``Driver._check_burst``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.params import make_params

from qwengyre.scheduler.core import GroupState, Scheduler, SchedulerError, SchedulerParams
from qwengyre.scheduler.events import (
    STANDALONE,
    Action,
    AssignGroups,
    Cancel,
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
from qwengyre.types import Outcome

pytestmark = pytest.mark.slow  # seconds to minutes; still in the default suite

# ---------------------------------------------------------------- parameters


@st.composite
def scheduler_params(draw: st.DrawFn) -> SchedulerParams:
    policy = draw(st.sampled_from(["elastic", "async", "colocate"]))
    cells = draw(st.integers(2 if policy == "async" else 1, 4))
    batch = draw(st.integers(1, 3))
    mu = draw(st.integers(1, 3))
    group_size = draw(st.integers(1, 3))
    standalone = draw(st.integers(0, 3))
    # Colocate dispatches extra groups only with a standalone pool to run them (C1-C3).
    phis = [0.0] if policy == "colocate" and not standalone else [0.0, 0.5, 1.0]
    phi = draw(st.sampled_from([x for x in phis if ((x + mu) * batch).is_integer()]))
    dispatch = draw(st.sampled_from(["boundary", "continuous"]))
    kwargs = dict(
        policy=policy,
        dispatch=dispatch,
        group_size=group_size,
        oversample=draw(st.integers(0, 2)),
        max_topups=draw(st.integers(0, 2)),
        batch=batch,
        mu=mu,
        phi=phi,
        cells=cells,
        cell_capacity=draw(st.integers(1, 6)),
        standalone_capacity=standalone,
        rho_min=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        supply=draw(st.sampled_from(["in_hand", "ready"])),
        tau_s=float(draw(st.integers(0, 5))),
        streaming=draw(st.booleans()),
        async_training_cells=draw(st.integers(1, cells - 1)) if policy == "async" else 1,
        min_valid=draw(st.one_of(st.none(), st.integers(1, group_size))),  # mostly None: N
        reserve=draw(st.integers(0, 3)) if dispatch == "boundary" else 0,
    )
    try:
        return SchedulerParams(**kwargs)
    except ValueError:  # continuous dispatch is refused where no cell could ever train
        kwargs["dispatch"] = "boundary"
        return SchedulerParams(**kwargs)


def valid_needed(params: SchedulerParams) -> int:
    """Valid rewards a group needs to be trained: N unless ``min_valid`` lowers it."""
    return params.min_valid or params.group_size


VALID_OUTCOMES = (Outcome.COMPLETED, Outcome.FAILED, Outcome.HARNESS_TIMEOUT)
INVALID_OUTCOMES = (
    Outcome.FAILED,
    Outcome.HARNESS_TIMEOUT,
    Outcome.OVERALL_TIMEOUT,
    Outcome.CANCELLED,
)
REWARDS = (1.0, 0.0, 0.5, -1.0)


def units_of(params: SchedulerParams) -> list[tuple[int, ...]]:
    """The cells that move together: one each (elastic), all (colocate), none (async)."""
    if params.policy == "elastic":
        return [(i,) for i in range(params.cells)]
    if params.policy == "colocate":
        return [tuple(range(params.cells))]
    return []


# ---------------------------------------------------------------- the driver


class Driver:
    """Answers the scheduler's actions and checks the invariants after each event.

    ``strict_moves``: every ``MoveCell`` is answered by its own ``CellMoved``, so the
    scheduler must never order a cell that is still in transition. Without it, the one
    known double order (a cell already on its way back to rollout is ordered back again,
    see ``test_a_cell_in_transition_is_never_ordered_again``) is tolerated: the new order
    replaces the outstanding one and gets one answer.
    """

    def __init__(self, params: SchedulerParams, *, strict_moves: bool = True) -> None:
        self.params = params
        self.strict_moves = strict_moves
        self.s = Scheduler(params)
        self.now = 0.0
        self.events: list[Event] = []
        self.outputs: list[list[Action]] = []
        # executions
        self.group_of: dict[int, int] = {}  # every dispatched execution -> its group
        self.queued: dict[int, int] = {}  # dispatched, neither launched nor withdrawn
        self.running: dict[int, int] = {}  # launched, not finished -> engine
        self.cancelled: set[int] = set()  # running executions the scheduler cancelled
        self.finished: set[int] = set()
        self.rewards: dict[int, float | None] = {}
        # groups and training
        self.dropped: set[int] = set()
        self.assigned: set[int] = set()
        self.trained_checked: set[int] = set()
        self.assigned_this_step = 0
        self.wanted = 0
        self.batch_closed = False
        # cells, publication, wakes, the supply timer of Eq 5
        self.pending_moves: dict[int, Role] = {}
        self.pending_publish: int | None = None
        self.wakes: list[float] = []
        self.supply_since: float | None = None
        self.training_set: frozenset[int] = frozenset()
        self.owed: set[int] = set()  # cells to return to rollout when they arrive
        # bursts
        self.burst_steps = 0  # steps done since the last boundary
        # measurements
        self.max_rise = 0  # the largest rise of w within a burst, over one event
        self.stalls = 0  # mid-burst dispatches beyond the reserve (stalled bursts)
        self.early_ends = 0  # bursts that ended before mu steps (stalled bursts)
        self.joins = 0

    # ------------------------------------------------------------ sending

    def send(self, event: Event) -> list[Action]:
        assert event.time >= self.now
        self.now = event.time
        s = self.s
        w_before = s.counters.waterlevel
        outstanding_before = s.counters.dispatched - s.counters.finished
        quota_before = s.counters.dispatched + s._reserve_left
        owed_before = {g.id: g.owed for g in s.groups.values() if g.owed}
        assigned_before = self.assigned_this_step
        roles_before = list(s.roles)
        actions = s.handle(event)
        self.events.append(event)
        self.outputs.append(actions)
        self._absorb(event, actions)
        self._check(event, actions, outstanding_before, roles_before)
        if self.params.dispatch == "boundary":
            self._check_burst(event, actions, w_before, quota_before, owed_before, assigned_before)
        assert s.stalls == self.stalls  # the scheduler counts exactly the stalls seen here
        return actions

    def start(self) -> list[Action]:
        return self.send(Start(self.now))

    def finish(self, eid: int, outcome: Outcome, reward: float | None) -> list[Action]:
        assert eid in self.running
        del self.running[eid]
        self.cancelled.discard(eid)
        self.finished.add(eid)
        self.rewards[eid] = reward
        return self.send(ExecutionFinished(self.now, eid, outcome, reward))

    def complete_move(self, cell: int) -> list[Action]:
        del self.pending_moves[cell]
        return self.send(CellMoved(self.now, cell))

    def complete_publication(self) -> list[Action]:
        version = self.pending_publish
        assert version is not None
        self.pending_publish = None
        return self.send(PublicationDone(self.now, version))

    def pull(self, count: int) -> list[Action]:
        self.wanted = count
        return self.send(PullGroups(self.now, self.s.version, count))

    def step_done(self) -> list[Action]:
        assert self.batch_closed
        return self.send(StepDone(self.now, self.s.version))

    def tick_wake(self) -> list[Action]:
        t = max(self.now, min(self.wakes))
        self.wakes = [w for w in self.wakes if w > t]
        return self.send(Tick(t))

    def advance(self, dt: float, tick: bool) -> list[Action]:
        self.now += dt
        return self.send(Tick(self.now)) if tick else []

    # ------------------------------------------------------------ answering actions

    def _absorb(self, event: Event, actions: list[Action]) -> None:
        s, p = self.s, self.params
        if isinstance(event, StepDone):  # the next step's batch starts empty
            self.assigned_this_step = self.wanted = 0
            self.batch_closed = False
        for a in actions:
            match a:
                case Dispatch():
                    assert a.version == s.published
                    assert a.execution_ids, a
                    assert a.group_id not in self.dropped and a.group_id not in self.assigned
                    for eid in a.execution_ids:
                        assert eid not in self.group_of, f"execution id {eid} reused"
                        self.group_of[eid] = a.group_id
                        self.queued[eid] = a.group_id
                case Launch():
                    eid = a.execution_id
                    assert a.version == s.published == s.executions[eid].version
                    assert eid in self.queued, f"launch of {eid}, which is not queued"
                    assert self.queued.pop(eid) == a.group_id
                    assert s.groups[a.group_id].executions[a.index] == eid
                    assert a.engine == STANDALONE or 0 <= a.engine < p.cells
                    self.running[eid] = a.engine
                case Cancel():
                    eid = a.execution_id
                    assert eid in self.running, f"cancel of {eid}, which is not running"
                    assert eid not in self.cancelled, f"{eid} cancelled twice"
                    self.cancelled.add(eid)
                case Reroute():
                    assert self.running.get(a.execution_id) == a.source, a
                    assert a.source != a.destination
                    self.running[a.execution_id] = a.destination
                case MoveCell():
                    assert 0 <= a.cell < p.cells
                    assert a.role in (Role.TRAINING, Role.ROLLOUT)
                    if a.cell in self.pending_moves:
                        pending = self.pending_moves[a.cell]
                        assert not self.strict_moves and pending == a.role == Role.ROLLOUT, (
                            f"MoveCell({a.cell}, {a.role}) while its move to {pending}"
                            " is still under way"
                        )
                    self.pending_moves[a.cell] = a.role
                case AssignGroups():
                    self._check_assignment(a)
                case DropGroup():
                    group = s.groups[a.group_id]
                    assert group.state is GroupState.DROPPED
                    assert len(group.valid) < valid_needed(p)
                    assert a.group_id not in self.assigned and a.group_id not in self.dropped
                    self.dropped.add(a.group_id)
                case Publish():  # after mu steps, or earlier when a burst stalls
                    assert self.pending_publish is None
                    assert a.version == s.version > s.published
                    self.pending_publish = a.version
                case WakeAt():
                    assert a.time >= self.now
                    self.wakes.append(a.time)
        # Executions of groups that no longer need them are withdrawn before launch.
        for eid, gid in list(self.queued.items()):
            if s.groups[gid].state is not GroupState.ROLLOUT:
                del self.queued[eid]

    def _check_assignment(self, a: AssignGroups) -> None:
        s, p = self.s, self.params
        assert a.step == s.version
        assert a.group_ids, a
        assert s.training_cells, "groups assigned with no cell training"
        prev_vd = -1
        for gid in a.group_ids:
            group = s.groups[gid]
            assert gid not in self.assigned, f"group {gid} assigned twice"
            assert gid not in self.dropped, f"dropped group {gid} assigned"
            assert group.state is GroupState.ASSIGNED and group.v_t == a.step
            assert group.v_t - group.v_d >= 0, "negative staleness"
            assert group.v_d >= prev_vd, "not oldest version first"
            prev_vd = group.v_d
            self._check_valid_rewards(gid)
            self.assigned.add(gid)
        for g in s.groups.values():  # nothing left ready is older than what was taken
            if g.state is GroupState.READY:
                assert g.v_d >= prev_vd
        self.assigned_this_step += len(a.group_ids)
        assert self.assigned_this_step <= p.batch
        assert a.closes_batch == (self.assigned_this_step == p.batch)
        if p.streaming:
            assert len(a.group_ids) <= self.wanted, "more groups than were pulled"
        else:
            assert a.closes_batch, "without streaming the batch is assigned whole"
        self.wanted = max(0, self.wanted - len(a.group_ids))
        self.batch_closed = a.closes_batch

    def _check_valid_rewards(self, gid: int) -> None:
        """N valid rewards, each the real float the driver reported; fewer (but at
        least ``min_valid``) only once every execution of the group is done."""
        group = self.s.groups[gid]
        n, p = len(group.valid), self.params
        assert valid_needed(p) <= n <= p.group_size, (gid, group.valid)
        if n < p.group_size:
            assert not group.pending, (gid, group.pending)
            assert all(e in self.finished for e in group.executions)
        for eid, reward in group.valid.items():
            assert self.group_of[eid] == gid
            assert isinstance(reward, float) and math.isfinite(reward)
            assert eid in self.finished and self.rewards[eid] == reward

    # ------------------------------------------------------------ invariants

    def _check(
        self,
        event: Event,
        actions: list[Action],
        outstanding_before: int,
        roles_before: list[Role],
    ) -> None:
        s, p = self.s, self.params
        c = s.counters
        # Counters: 0 <= f <= p <= d; queued = d - p; running = p - f.
        assert 0 <= c.finished <= c.launched <= c.dispatched, c
        assert c.queued == len(self.queued), (c, sorted(self.queued))
        assert c.running == len(self.running), (c, sorted(self.running))
        assert c.finished == len(self.finished)
        # Engines: where the scheduler thinks each execution runs, within capacity,
        # only on engines that serve rollout.
        on: dict[int, int] = {}
        for engine in [STANDALONE, *range(p.cells)]:
            load = s.running_on(engine)
            cap = p.standalone_capacity if engine == STANDALONE else p.cell_capacity
            assert len(load) <= cap, f"engine {engine} holds {len(load)} > {cap}"
            if engine != STANDALONE and s.roles[engine] is not Role.ROLLOUT:
                assert not load, f"cell {engine} is {s.roles[engine]} but runs {set(load)}"
            on.update(dict.fromkeys(load, engine))
        assert on == self.running, (on, self.running)
        # Eq 3 and Eq 4.
        serving = sum(1 for r in s.roles if r is Role.ROLLOUT)
        assert s.capacity == serving * p.cell_capacity + p.standalone_capacity
        assert c.running <= s.capacity
        assert c.queued == 0 or c.running == s.capacity, (c, s.capacity)
        # Outstanding executions: within a burst only this call's dispatches add any.
        if not isinstance(event, Start | PublicationDone):
            added = sum(len(a.execution_ids) for a in actions if isinstance(a, Dispatch))
            outstanding = c.dispatched - c.finished
            assert outstanding <= outstanding_before + added, (outstanding_before, c, added)
        if p.dispatch == "continuous":
            assert c.reserved == 0 and s._reserve_left == 0
        else:
            # The reserve held is what top-ups could still take: never more than the
            # groups in rollout may still get under their max_topups allowance.
            could_need = sum(
                max(0, p.executions_per_group + p.max_topups - len(g.executions) - g.owed)
                for g in s.groups.values()
                if g.state is GroupState.ROLLOUT
            )
            assert c.reserved == min(s._reserve_left, could_need)
            assert 0 <= s._reserve_left <= p.reserve
        self._check_groups()
        self._check_training()
        self._check_cells(event, actions, roles_before)
        self._check_join_rule(event, actions, roles_before)

    def _check_groups(self) -> None:
        s, p = self.s, self.params
        held = {GroupState.ROLLOUT}
        if p.dispatch == "boundary":
            held |= {GroupState.READY, GroupState.ASSIGNED}
        assert sum(1 for g in s.groups.values() if g.state in held) <= p.queue_depth
        ready = 0
        for gid, g in s.groups.items():
            if g.state is GroupState.READY:
                ready += 1
            if g.state in (GroupState.READY, GroupState.ASSIGNED):
                self._check_valid_rewards(gid)
            elif g.state is GroupState.TRAINED and gid not in self.trained_checked:
                self._check_valid_rewards(gid)
                self.trained_checked.add(gid)
            elif g.state is GroupState.DROPPED:
                assert gid in self.dropped and g.v_t is None
            if g.v_t is not None:
                assert gid in self.assigned and g.v_t - g.v_d >= 0
        assert s.ready_unassigned == ready
        assert 0 <= s.published <= s.version

    def _check_training(self) -> None:
        """Ready groups reach a training cell as soon as the rules allow."""
        s, p = self.s, self.params
        assert s._wanted == self.wanted
        if not s.training_cells or s.publishing:
            return
        if p.streaming:
            assert min(self.wanted, s.batch_needs, s.ready_unassigned) == 0
        else:
            assert not 0 < s.batch_needs <= s.ready_unassigned

    def _check_cells(self, event: Event, actions: list[Action], roles_before: list[Role]) -> None:
        s, p = self.s, self.params
        moves = [a for a in actions if isinstance(a, MoveCell)]
        joins = {m.cell for m in moves if m.role is Role.TRAINING}
        returns = {m.cell for m in moves if m.role is Role.ROLLOUT}
        ends_burst = isinstance(event, PublicationDone) or any(
            isinstance(a, Publish) for a in actions
        )
        arrived_owed = isinstance(event, CellMoved) and event.cell in self.owed
        if arrived_owed:  # a cell owed a return goes back as soon as it arrives
            assert returns == {event.cell}, (event, returns)
            self.owed.discard(event.cell)
        elif returns:  # cells stay in training to the end of the burst
            assert ends_burst, returns
        published = any(isinstance(a, Publish) for a in actions)
        if isinstance(event, StepDone) and p.dispatch == "continuous":  # no early ends
            assert published == (s.version % p.mu == 0)
        if published and p.policy == "elastic":  # satellites return
            self._expect_returns(returns, set(range(1, p.cells)), roles_before)
        if isinstance(event, PublicationDone) and units_of(p):
            self._check_eq6(actions, roles_before, returns)
        if p.policy == "async":
            assert not moves
            assert s.training_cells == tuple(range(p.async_training_cells))
            return
        if p.policy == "colocate":  # the whole pool moves together
            assert len(joins) in (0, p.cells), moves
            return
        training = frozenset(  # cells owed a return are on their way back already
            i
            for i, r in enumerate(s.roles)
            if r in (Role.TO_TRAINING, Role.TRAINING) and i not in self.owed
        )
        assert training == frozenset(range(len(training))), f"not a prefix: {s.roles}"
        assert sum(1 for r in s.roles if r is Role.TO_TRAINING) <= 1, f"not serial: {s.roles}"
        if Role.TO_ROLLOUT not in s.roles:
            out_of_rollout = [
                i for i, r in enumerate(s.roles) if r is not Role.ROLLOUT and i not in self.owed
            ]
            assert out_of_rollout == list(range(len(out_of_rollout))), s.roles
        if not ends_burst and not arrived_owed:  # k(t) only grows within a burst
            assert self.training_set <= training, (self.training_set, s.roles)
        self.training_set = training

    def _supply(self, exclude: set[int]) -> int:
        """Groups that can still fill the current step without new dispatches: ready and
        unassigned, or in rollout with enough valid + pending rewards, not counting the
        executions in ``exclude`` (dispatched by the event being checked)."""
        s, need = self.s, valid_needed(self.params)
        viable = sum(
            1
            for g in s.groups.values()
            if g.state is GroupState.ROLLOUT and len(g.valid) + len(g.pending - exclude) >= need
        )
        return s.ready_unassigned + viable

    def _check_burst(
        self,
        event: Event,
        actions: list[Action],
        w_before: int,
        quota_before: int,
        owed_before: dict[int, int],
        assigned_before: int,
    ) -> None:
        """Boundary dispatch: d(t) is fixed within a burst (plus the reserve), w(t) never
        rises, owed top-ups come first at the next boundary, a burst ends after mu steps.

        A burst *stalls* when its groups can no longer fill the current step (ready +
        non-short groups in rollout < what the step needs): then it ends early if it has
        trained a step and the current step holds no group, or else dispatches the owed
        top-ups and the dropped slots at once, the one way d and w rise within a burst.
        """
        s, p = self.s, self.params
        c = s.counters
        dispatches = [a for a in actions if isinstance(a, Dispatch)]
        new = {eid for a in dispatches for eid in a.execution_ids}
        published = [a for a in actions if isinstance(a, Publish)]
        if isinstance(event, StepDone):
            self.burst_steps += 1
            assert published or self.burst_steps < p.mu, "a burst of mu steps did not end"
        if isinstance(event, Start | PublicationDone):
            self.burst_steps = 0
            # Owed top-ups first, oldest group first, at the published version; then
            # new groups (Eq 1). Nothing stays owed.
            topups = [(a.group_id, len(a.execution_ids)) for a in dispatches if a.topup]
            assert topups == sorted(owed_before.items()), (topups, owed_before)
            assert all(not a.topup for a in dispatches[len(topups) :])
            assert all(a.version == s.published for a in dispatches)
            assert not any(g.owed for g in s.groups.values())
            assert s._reserve_left == p.reserve
            return
        if published:
            self.burst_steps, steps = 0, self.burst_steps
            if steps < p.mu:  # ended early
                assigned = 0 if isinstance(event, StepDone) else assigned_before
                assert steps > 0 and assigned == 0 and not dispatches
                assert self._supply(set()) < p.batch, "an early end without a stall"
                self.early_ends += 1
        quota = c.dispatched + s._reserve_left
        if quota <= quota_before:
            assert c.waterlevel <= w_before, (w_before, c.waterlevel)
            assert all(a.topup for a in dispatches), "a new group mid-burst"
            return
        # A stalled burst: the step could not be filled without these dispatches.
        assert self._supply(new) < s.batch_needs, (self._supply(new), s.batch_needs)
        assert self._supply(set()) >= s.batch_needs, "the stall was not resolved"
        assert not any(g.owed for g in s.groups.values())
        self.stalls += 1
        self.max_rise = max(self.max_rise, c.waterlevel - w_before)

    def _expect_returns(self, returns: set[int], cells: set[int], roles_before: list[Role]):
        """``cells`` that train go back to rollout now; one still moving to training may
        instead be owed its return until it arrives. (A cell already on its way back
        may be ordered again only where ``strict_moves`` is off.)"""
        due = {c for c in cells if roles_before[c] in (Role.TRAINING, Role.TO_TRAINING)}
        tolerated = {c for c in cells if roles_before[c] is Role.TO_ROLLOUT}
        assert returns <= due | tolerated, (returns, roles_before)
        for cell in due - returns:
            assert roles_before[cell] is Role.TO_TRAINING, (cell, roles_before)
            self.owed.add(cell)

    def _check_eq6(self, actions: list[Action], roles_before: list[Role], returns: set[int]):
        """Eq 6: after publication the core stays only if supply and room allow."""
        s, p = self.s, self.params
        core = units_of(p)[0]
        if roles_before[0] is Role.ROLLOUT:
            assert not returns
            return
        assigned = sum(len(a.group_ids) for a in actions if isinstance(a, AssignGroups))
        room = (p.cells - len(core)) * p.cell_capacity + p.standalone_capacity
        stays = (
            s.ready_unassigned + assigned >= p.rho_min * p.batch and s.counters.waterlevel <= room
        )
        if stays:
            assert not returns, (stays, returns)
        else:
            self._expect_returns(returns, set(core), roles_before)

    def _check_join_rule(
        self, event: Event, actions: list[Action], roles_before: list[Role]
    ) -> None:
        """Eq 5 plus the supply check held for tau, modelled independently, both ways:
        a unit joins only when they hold, and when they hold a join or a wake-up is due."""
        s, p = self.s, self.params
        units = units_of(p)
        if not units:
            return
        if isinstance(event, StepDone) or (
            isinstance(event, CellMoved) and roles_before[event.cell] is Role.TO_TRAINING
        ):
            self.supply_since = None  # reset at each batch start and after each transition
        joins = sorted(
            m.cell for m in actions if isinstance(m, MoveCell) and m.role is Role.TRAINING
        )
        roles = list(s.roles)
        for cell in joins:  # the roles as the join rule saw them
            roles[cell] = Role.ROLLOUT
        joined = sum(1 for u in units if roles[u[0]] is Role.TRAINING)
        moving = any(r in (Role.TO_TRAINING, Role.TO_ROLLOUT) for r in roles)
        in_hand = p.batch - s.batch_needs if p.supply == "in_hand" and not s.publishing else 0
        supply = min(s.ready_unassigned, s.batch_needs) + in_hand >= p.rho_min * p.batch
        if s.publishing or moving or joined == len(units) or not supply:
            assert not joins, (joins, roles, supply)
            self.supply_since = None
            return
        if self.supply_since is None:
            self.supply_since = self.now
        due = self.supply_since + p.tau_s
        room = sum(len(u) for u in units[joined + 1 :]) * p.cell_capacity
        fits = s.counters.waterlevel <= room + p.standalone_capacity  # Eq 5
        if joins:
            assert joins == list(units[joined]), (joins, joined)
            assert fits and self.now >= due, (fits, self.now, due)
            self.supply_since = None
            self.joins += 1
        elif fits:
            assert self.now < due, "Eq 5 and the supply check held for tau; nobody joined"
            assert any(t <= due for t in self.wakes), f"no wake-up by {due}: {self.wakes}"

    # ------------------------------------------------------------ liveness

    def check_not_stuck(self) -> None:
        """Boundary dispatch: with nothing left to answer, a batch can still be trained."""
        s = self.s
        if self.params.dispatch != "boundary":
            return
        if self.running or self.pending_moves or self.pending_publish is not None or self.wakes:
            return
        assert s.training_cells, f"stuck: nothing to answer, nothing training ({s.roles})"
        assert s.ready_unassigned >= s.batch_needs, (
            f"stuck: the batch needs {s.batch_needs}, {s.ready_unassigned} ready, nothing runs"
        )


# ---------------------------------------------------------------- random runs

MOVES = (
    ["finish"] * 6
    + ["cancelled"] * 2
    + ["cell"] * 2
    + ["publication"] * 2
    + ["pull"] * 2
    + ["step"] * 3
    + ["wake", "advance", "illegal"]
)


def legal_moves(d: Driver) -> list[str]:
    ok = {
        "finish": any(e not in d.cancelled for e in d.running),
        "cancelled": bool(d.cancelled),
        "cell": bool(d.pending_moves),
        "publication": d.pending_publish is not None,
        "pull": bool(d.s.training_cells),
        "step": d.batch_closed,
        "wake": bool(d.wakes),
        "advance": True,
        "illegal": True,
    }
    return [m for m in MOVES if ok[m]]


def illegal_events(d: Driver) -> list[Event]:
    """Events that contradict the scheduler's state (a driver bug), at the current time."""
    s, now = d.s, d.now
    events: list[Event] = [
        Start(now),
        ExecutionFinished(now, len(d.group_of) + 7, Outcome.COMPLETED, 1.0),
        CellMoved(now, d.params.cells),
        StepDone(now, s.version + 1),
        PublicationDone(now, s.version + 1),
        PullGroups(now, s.version + 1, 1),
        PullGroups(now, s.version, -1),
    ]
    events += [ExecutionFinished(now, e, Outcome.COMPLETED, 1.0) for e in sorted(d.finished)[:1]]
    events += [ExecutionFinished(now, e, Outcome.COMPLETED, 1.0) for e in sorted(d.queued)[:1]]
    events += [ExecutionFinished(now, e, Outcome.CANCELLED, 0.0) for e in sorted(d.running)[:1]]
    events += [
        CellMoved(now, c) for c, r in enumerate(s.roles) if r in (Role.ROLLOUT, Role.TRAINING)
    ]
    if not d.batch_closed:
        events.append(StepDone(now, s.version))
    if d.pending_publish is None:
        events.append(PublicationDone(now, s.version))
    last = d.events[-1].time  # the driver's clock may have run ahead silently
    if last >= 0.5:
        events.append(Tick(last - 0.5))
    return events


def views(s: Scheduler) -> tuple:
    return (
        s.counters,
        tuple(s.roles),
        s.version,
        s.published,
        s.capacity,
        s.ready_unassigned,
        s.batch_needs,
        s._wanted,
        s.publishing,
        tuple((g.id, g.state, len(g.valid), len(g.pending)) for g in s.groups.values()),
    )


def play(d: Driver, data: st.DataObject, move: str) -> None:
    """Any legal move but "finish" (whose results each test draws its own way)."""
    params = d.params
    if move == "cancelled":
        gone = sorted(d.cancelled)
        eid = gone[data.draw(st.integers(0, len(gone) - 1), label="cancelled")]
        d.finish(eid, Outcome.CANCELLED, None)
    elif move == "cell":
        cells = sorted(d.pending_moves)
        d.complete_move(cells[data.draw(st.integers(0, len(cells) - 1), label="cell")])
    elif move == "publication":
        d.complete_publication()
    elif move == "pull":  # 1..B first (they shrink best), then 0
        k = data.draw(st.integers(0, params.batch), label="pull")
        d.pull((k + 1) % (params.batch + 1))
    elif move == "step":
        d.step_done()
    elif move == "wake":
        d.tick_wake()
    elif move == "illegal":  # refused, and changes nothing (the replay checks it)
        bad = illegal_events(d)
        event = bad[data.draw(st.integers(0, len(bad) - 1), label="illegal")]
        before = views(d.s)
        with pytest.raises(SchedulerError):
            d.s.handle(event)
            pytest.fail(f"{event} was accepted")
        assert views(d.s) == before
    else:
        dt = data.draw(st.sampled_from([0.5, 1.0, 2.0, 5.0]), label="dt")
        d.advance(dt, tick=data.draw(st.booleans(), label="tick"))
    d.check_not_stuck()


def run_random(
    data: st.DataObject,
    params: SchedulerParams,
    steps: int,
    *,
    valid_only: bool = False,
    strict_moves: bool = False,
) -> Driver:
    d = Driver(params, strict_moves=strict_moves)
    d.start()
    for _ in range(steps):
        moves = legal_moves(d)
        move = moves[data.draw(st.integers(0, len(moves) - 1), label="move")]
        if move == "finish":
            live = sorted(e for e in d.running if e not in d.cancelled)
            eid = live[data.draw(st.integers(0, len(live) - 1), label="execution")]
            r = data.draw(st.integers(0, 8 if valid_only else 12), label="result")
            if r < 9:
                d.finish(eid, VALID_OUTCOMES[r % 3], REWARDS[r % 4])
            else:
                d.finish(eid, INVALID_OUTCOMES[r - 9], None)
            d.check_not_stuck()
        else:
            play(d, data, move)
    # Purity: the same events give the same actions (and state) to a fresh scheduler;
    # the refused events in between changed nothing.
    replay = Scheduler(params)
    assert [replay.handle(e) for e in d.events] == d.outputs
    assert views(replay) == views(d.s)
    assert replay.consumed() == d.s.consumed()
    return d


SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=120, **SETTINGS)
@given(params=scheduler_params(), data=st.data())
def test_invariants_hold_under_any_legal_driver(params: SchedulerParams, data: st.DataObject):
    run_random(data, params, steps=300)


@settings(max_examples=60, **SETTINGS)
@given(params=scheduler_params(), data=st.data())
def test_waterlevel_never_rises_within_a_burst_when_every_reward_is_valid(
    params: SchedulerParams, data: st.DataObject
):
    """Boundary dispatch, no oversampling, every reward valid: no top-ups, no drops, no
    stalls, so w can only fall between publications (docs/design.md §4)."""
    params = dataclasses.replace(params, oversample=0, dispatch="boundary")
    d = run_random(data, params, steps=300, valid_only=True)
    assert d.stalls == d.early_ends == 0


@pytest.mark.parametrize("reserve", [0, 2])
@settings(max_examples=60, **SETTINGS)
@given(params=scheduler_params(), data=st.data())
def test_with_invalid_rewards_d_and_w_never_rise_within_a_burst(
    reserve: int, params: SchedulerParams, data: st.DataObject
):
    """Every policy, boundary dispatch, random invalid rewards (about 1 result in 3):
    top-ups come out of the reserve or wait for the next boundary, drops are refilled
    there, so the quota d + reserve left and w never rise between publications
    (``Driver._check_burst``), except when a burst stalls, which needs more short groups
    than its extra ones (phi B) cover. With phi >= 1 and min_valid 1 a single short group
    never stalls a burst: no rise at all."""
    params = dataclasses.replace(params, dispatch="boundary", reserve=reserve)
    d = run_random(data, params, steps=300)
    if d.stalls == 0:
        assert d.max_rise == 0


@settings(max_examples=40, **SETTINGS)
@given(params=scheduler_params(), data=st.data())
def test_a_single_short_group_never_stalls_a_burst_with_a_batch_of_extra_groups(
    params: SchedulerParams, data: st.DataObject
):
    """phi = 1 (B extra groups): one invalid result per burst at most is far less than
    the slack, so d and w never rise within a burst and no burst ends early."""
    if params.policy == "colocate":
        params = dataclasses.replace(params, policy="elastic")
    params = dataclasses.replace(params, dispatch="boundary", phi=1.0, oversample=0)
    d = Driver(params)
    d.start()
    invalid_in_burst = False
    for _ in range(300):
        if isinstance(d.events[-1], PublicationDone):
            invalid_in_burst = False
        moves = [m for m in legal_moves(d) if m != "illegal"]
        move = moves[data.draw(st.integers(0, len(moves) - 1), label="move")]
        if move == "finish":
            live = sorted(e for e in d.running if e not in d.cancelled)
            eid = live[data.draw(st.integers(0, len(live) - 1), label="execution")]
            if not invalid_in_burst and data.draw(st.booleans(), label="invalid"):
                invalid_in_burst = True
                d.finish(eid, Outcome.OVERALL_TIMEOUT, None)
            else:
                d.finish(eid, Outcome.COMPLETED, 1.0)
            d.check_not_stuck()
        else:
            play(d, data, move)
    assert d.stalls == d.early_ends == 0 and d.max_rise == 0


# ------------------------------------------------ bugs found by the random driver: regressions


def _satellite_still_joining(d: Driver) -> None:
    # Start: groups 0, 1 (executions 0, 1) run on cell 1.
    assert d.finish(0, Outcome.COMPLETED, 1.0)[-1] == MoveCell(0, Role.TRAINING)
    d.finish(1, Outcome.COMPLETED, 1.0)  # w = 0: room for the satellite too
    assert MoveCell(1, Role.TRAINING) in d.complete_move(0)  # the core arrives
    d.pull(1)  # the batch closes while cell 1 is still moving to training
    d.step_done()  # -> MoveCell(1, ROLLOUT), Publish(1): cell 1 is ordered twice


def _satellite_still_returning(d: Driver) -> None:
    d.finish(0, Outcome.COMPLETED, 1.0)  # the core joins
    d.finish(1, Outcome.COMPLETED, 1.0)
    d.complete_move(0)  # the core arrives; the satellite joins
    d.complete_move(1)  # the satellite arrives
    d.pull(1)
    d.step_done()  # end of burst: MoveCell(1, ROLLOUT), Publish(1)
    d.complete_publication()  # Eq 6: group 1 is ready and w fits, the core stays
    d.pull(1)
    d.step_done()  # cell 1 is still on its way back: MoveCell(1, ROLLOUT) again


def _colocate_pool_still_joining(d: Driver) -> None:
    # Start: group 0 (execution 0) runs on cell 1.
    assert len(d.finish(0, Outcome.COMPLETED, 1.0)) == 2  # MoveCell(0), MoveCell(1)
    d.complete_move(0)  # cell 0 trains; cell 1 is still moving to training
    d.pull(1)
    d.step_done()
    d.complete_publication()  # Eq 6 returns the pool: MoveCell(1, ROLLOUT) too


ELASTIC_2 = dict(batch=1, group_size=1, mu=1, phi=1, cells=2, cell_capacity=2, rho_min=1)
COLOCATE_2 = dict(policy="colocate", batch=1, group_size=1, mu=1, cells=2, cell_capacity=1)
DOUBLE_MOVES = {
    "elastic-satellite-joining": (ELASTIC_2, _satellite_still_joining),
    "elastic-satellite-returning": (ELASTIC_2, _satellite_still_returning),
    "colocate-pool-joining": (COLOCATE_2, _colocate_pool_still_joining),
}


@pytest.mark.parametrize(
    "case",
    [
        "elastic-satellite-joining",
        "colocate-pool-joining",
        "elastic-satellite-returning",
    ],
)
def test_a_cell_in_transition_is_never_ordered_again(case: str):
    """Found by the random driver. Each MoveCell gets its own CellMoved, so a second
    order for a cell that is still moving is ambiguous: the first CellMoved completes
    the *second* move in the scheduler's books (a cell becoming a trainer was taken for
    a rollout engine and got launches), and the second CellMoved is refused with
    SchedulerError("cell 1 is not in transition"). Now a cell still moving to training
    is returned when it arrives (the two "joining" cases) and a cell already on its way
    back gets no second order (moves are idempotent).

    - elastic-satellite-joining: the satellite joins; the core closes the burst's last
      step before it arrives; StepDone returns it (MoveCell(1, ROLLOUT)).
    - elastic-satellite-returning: the core stays for the next burst (Eq 6) and ends it
      before the returning satellite arrives; StepDone orders it back again.
    - colocate-pool-joining: cell 0 arrives and trains the burst; at PublicationDone
      Eq 6 returns the pool, including cell 1 that is still moving to training.
    """
    kwargs, scenario = DOUBLE_MOVES[case]
    d = Driver(make_params(tau_s=0, **kwargs), strict_moves=True)
    d.start()
    try:
        scenario(d)  # the strict driver asserts at the double order
        # After a fix: answer what is outstanding; the books must agree all the way.
        while d.pending_moves or d.pending_publish is not None:
            if d.pending_moves:
                d.complete_move(min(d.pending_moves))
            else:
                d.complete_publication()
    except SchedulerError as e:  # a contract-following driver is refused
        raise AssertionError(str(e)) from e


CONTINUOUS_STARVES = {
    "colocate": dict(
        policy="colocate", dispatch="continuous", batch=1, group_size=1, cells=1, cell_capacity=1
    ),
    "elastic": dict(dispatch="continuous", batch=1, group_size=1, phi=1, cells=2, cell_capacity=1),
}


@pytest.mark.parametrize("policy", sorted(CONTINUOUS_STARVES))
def test_continuous_dispatch_is_refused_where_it_would_starve_training(policy: str):
    """Found by the random driver: under continuous dispatch a ready group is replaced
    at once, so the waterlevel never drains below the queue depth (in executions). Eq 5
    needs w <= C_s (colocate) or w <= (K - 1) C_e + C_s (the core joining, elastic), so
    when Q (N + o) exceeds that no cell ever joins, nothing is trained and ready groups
    pile up without bound. Such a configuration must be refused, or training must start."""
    try:
        params = make_params(tau_s=0, **CONTINUOUS_STARVES[policy])
    except ValueError:
        return  # refused up front: fine
    d = Driver(params)
    d.start()
    for _ in range(20):  # every execution succeeds at once
        d.finish(min(d.running), Outcome.COMPLETED, 1.0)
        d.advance(1.0, tick=True)
    assert d.joins > 0 or d.s.training_cells, "20 batches ready, no cell ever trained"


def test_a_refused_event_does_not_move_the_clock():
    """SchedulerError promises that the state is unchanged, the clock included: after a
    refused event at t=5, a legal event at t=2 (after the last accepted one) is taken."""
    s = Scheduler(make_params(batch=1, group_size=1, cells=1, cell_capacity=1))
    s.handle(Start(0.0))  # execution 0 runs
    with pytest.raises(SchedulerError, match="never launched"):
        s.handle(ExecutionFinished(5.0, 99, Outcome.COMPLETED, 1.0))
    s.handle(ExecutionFinished(2.0, 0, Outcome.COMPLETED, 1.0))
