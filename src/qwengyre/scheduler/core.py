"""The scheduler: boundary/continuous dispatch, elastic cells, bursts (docs/design.md §2).

A pure, deterministic state machine: :meth:`Scheduler.handle` takes one event and
returns the actions to carry out. It never reads a clock, sleeps or does I/O, so
the simulator (virtual clock) and the live runtime (real clock) drive the same code:

    for action in scheduler.handle(event):
        await execute(action)

Counters (in executions): ``d`` dispatched (minus surplus withdrawn before launch),
``p`` launched, ``f`` terminated; ``0 <= f <= p <= d``; queued = d - p,
running = p - f. The waterlevel is ``w = d - f + reserved`` (:class:`Counters`), where
``reserved`` is the replacement reserve still held (0 unless ``groups.reserve`` > 0).

Boundary dispatch keeps d(t) fixed within a burst (the paper: "the launches in
Equation 4 use the existing quota, so d(t) remains fixed within the burst"), so that
w(t) never rises between publications and a cell that joined by Eq 5 keeps its room:

- A group that falls short (valid + pending < needed: N, or ``min_valid``) dispatches
  nothing mid-burst. Its top-ups are *owed* and dispatched at the next boundary, right
  after :class:`PublicationDone` and ahead of the new groups (so they sample the newly
  published weights). Until then the group waits in rollout; the burst trains other
  groups (oldest version first), so a Colocate pool no longer waits for top-up rounds.
- A group past its ``max_topups`` allowance is dropped at once (pending executions
  cancelled, :class:`DropGroup`); the ordinary Eq 1 refill replaces it at the boundary.
- The replacement reserve (``groups.reserve`` = R, an extension; 0 is the paper): each
  boundary grants R executions of extra quota, and a short group's top-ups launch at
  once out of what is left of it (the rest is owed as above). The held reserve,
  ``min(reserve left, top-ups the groups in rollout may still get)``, counts in the
  waterlevel. A top-up of k executions raises d - f by k and lowers both terms of the
  minimum by k; a finished execution lowers d - f and raises neither term; a group that
  leaves rollout only lowers the second. So w(t) never rises within a burst, Eqs 5 and
  6 keep room for the reserve, and w reaches 0 when rollout ends (a Colocate pool can
  switch).
- A burst the held groups can no longer fill (ready + non-short groups in rollout <
  what the current step still needs) would wait forever for a boundary. If it has
  trained a step and the current step has no group yet, the boundary comes early: the
  burst ends (:class:`Publish`) after fewer than mu steps. Otherwise (the first step of
  the burst, or a step already partly assigned) the owed top-ups and a new group per
  drop are dispatched at once: the one case where d(t) and w(t) rise within a burst,
  only reachable when more groups fall short than the phi*B extra groups cover.

Continuous dispatch keeps its slot rule: top-ups, and a new group for a dropped one,
are dispatched at once. It has no bursts in which d(t) could stay fixed: a group frees
its slot when it is ready and is replaced at once anyway.

Staleness stays Eq 2's quantity, one value per group: v_t - v_d, with v_d the version
published when the group was first dispatched. A top-up dispatched later samples newer
weights; :class:`Launch` carries the version each execution starts with (also kept on
:class:`Execution`), so drivers can report the version each execution actually used.

Policies share everything but the grouping of cells into *units* that move together:

- ``elastic``: every cell is its own unit; units join training one at a time in
  prefix order (core first) when Eq 5 and the supply check hold;
- ``colocate``: one unit holding every cell: the whole pool switches together,
  which by Eq 5 (w <= C_s) waits for the rollout tail. With a standalone pool it may
  dispatch extra groups (phi > 0, the paper's C1-C3): the pool switches once what is
  still running fits on the standalone engines, which keep those harnesses running;
- ``async``: no unit moves; cells 0..T-1 train for the whole run.

Any cell other than the core may be lost (:class:`CellLost`), whatever its role: it
leaves its unit, and training stays a prefix of the live cells (the runtime re-forms the
cells' groups without it, so the cells past it train on; under ``async`` the cells past
it serve rollout for the rest of the run, those in training returning at once), a switch
it was making never ends, and its executions move to the engines that serve, to ones
with room first: a loss is not planned by Eq 5, so an engine may hold more than its
capacity until its executions end (nothing new launches there meanwhile). A cell lost in
training leaves the step: the driver gives the micro-steps it claimed, and those of the
cells past it until the groups are re-formed, to the cells that stay.

No engine left to serve: when no cell serves rollout or is on its way back and there is
no standalone pool, while executions wait for an engine (the lost cell's, or queued
ones), the newest unit in training returns to rollout (under ``async``, the highest
training cell other than the core, for good). Until it serves, the lost cell's
executions wait *parked* (on no engine; their harnesses keep running and the proxy holds
their calls) and are rerouted as soon as an engine serves. Only a run that could never
serve and train again refuses the loss (:meth:`Scheduler.why_not_lose`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

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
from qwengyre.types import Outcome


class SchedulerError(ValueError):
    """An event that contradicts the scheduler's state (a driver bug); state is unchanged."""


@dataclass(frozen=True, kw_only=True)
class SchedulerParams:
    """Everything the scheduler decides with, drawn from the config tree by
    :meth:`qwengyre.config.Config.scheduler_params` (the pure core reads no config).

    No field has a default: the config tree is the one place defaults are declared
    (each field's meaning and range is documented on its config key)."""

    policy: str  # scheduler.policy: "elastic", "async" or "colocate"
    dispatch: str  # scheduler.dispatch: "boundary" or "continuous"
    group_size: int  # groups.size, N
    oversample: int  # groups.oversample
    max_topups: int  # groups.max_topups
    min_valid: int | None  # groups.min_valid; None: a group needs all N valid rewards
    batch: int  # groups.batch, B
    mu: int  # scheduler.mu
    phi: float  # scheduler.phi
    cells: int  # cells.count, K
    cell_capacity: int  # cells.capacity, C_e
    standalone_capacity: int  # cells.standalone_capacity, C_s
    rho_min: float  # scheduler.rho_min
    tau_s: float  # scheduler.tau_s
    supply: str  # scheduler.supply: what the supply check counts, "in_hand" or "ready"
    streaming: bool  # scheduler.streaming
    async_training_cells: int  # scheduler.async_training_cells
    reserve: int  # groups.reserve: executions of quota held back per burst for top-ups

    def __post_init__(self) -> None:
        """Refuse combinations that could never train; messages name the config keys."""
        if self.policy not in ("elastic", "async", "colocate"):
            raise ValueError(f"scheduler.policy={self.policy!r}; allowed: elastic, async, colocate")
        if self.supply not in ("in_hand", "ready"):
            raise ValueError(f"scheduler.supply={self.supply!r}; allowed: in_hand, ready")
        if self.dispatch not in ("boundary", "continuous"):
            raise ValueError(f"scheduler.dispatch={self.dispatch!r}; allowed: boundary, continuous")
        if self.policy == "async" and not 0 < self.async_training_cells < self.cells:
            raise ValueError(
                f"scheduler.async_training_cells={self.async_training_cells} must be in"
                f" [1, cells.count - 1 = {self.cells - 1}] (async needs a rollout cell)"
            )
        if self.reserve < 0:
            raise ValueError(f"groups.reserve={self.reserve} must be >= 0")
        if self.reserve and self.dispatch != "boundary":
            raise ValueError(
                f"groups.reserve={self.reserve} applies to dispatch boundary only: continuous"
                " dispatch launches top-ups at once anyway"
            )
        if self.min_valid is not None and not 1 <= self.min_valid <= self.group_size:
            raise ValueError(
                f"groups.min_valid={self.min_valid} must be in [1, groups.size = {self.group_size}]"
            )
        depth = (self.phi + self.mu) * self.batch
        if not math.isclose(depth, round(depth), abs_tol=1e-9):
            raise ValueError(
                f"(scheduler.phi + scheduler.mu) * groups.batch = {depth:g} groups must be a"
                " whole number"
            )
        if self.policy == "colocate" and self.phi > 0 and self.standalone_capacity == 0:
            raise ValueError(
                f"scheduler.phi={self.phi} with policy colocate needs a standalone pool"
                " (cells.standalone_capacity > 0): the extra groups' executions must keep"
                " running somewhere while the whole pool trains; without one, use phi=0"
            )
        if self.policy == "colocate" and self.dispatch == "continuous":
            raise ValueError(
                "policy colocate needs dispatch boundary: continuous dispatch keeps rollout"
                " busy forever, so the whole pool could never switch to training"
            )
        outstanding = self.queue_depth * self.executions_per_group
        room = (self.cells - 1) * self.cell_capacity + self.standalone_capacity
        if self.policy == "elastic" and self.dispatch == "continuous" and outstanding > room:
            raise ValueError(
                f"elastic with continuous dispatch keeps up to {outstanding} executions"
                f" outstanding, more than the {room} that fit with the core in training"
                " (Eq 5), so no cell could ever train; lower scheduler.phi/mu or use"
                " dispatch boundary"
            )

    @property
    def queue_depth(self) -> int:
        """Eq 1: target depth in groups, ``Q = (phi + mu) * B``."""
        return round((self.phi + self.mu) * self.batch)

    @property
    def executions_per_group(self) -> int:
        return self.group_size + self.oversample

    @property
    def valid_needed(self) -> int:
        """Valid rewards a finished group needs to be trained (advantages over those)."""
        return self.group_size if self.min_valid is None else self.min_valid


class GroupState(StrEnum):
    ROLLOUT = "rollout"  # waiting for N valid rewards (or for owed top-ups)
    READY = "ready"  # N valid rewards, not yet in a batch
    ASSIGNED = "assigned"  # in the batch of step ``v_t``
    TRAINED = "trained"  # its step is done
    DROPPED = "dropped"  # could not reach N valid rewards


@dataclass(kw_only=True)
class Group:
    """A rollout group as the scheduler sees it."""

    id: int
    v_d: int
    state: GroupState = GroupState.ROLLOUT
    executions: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # queued or running, not cancelled
    valid: dict[int, float] = field(default_factory=dict)  # execution id -> reward, first N
    v_t: int | None = None  # the version before the step that consumes it
    owed: int = 0  # top-ups due at the next boundary (boundary dispatch)
    replaced: int = 0  # executions lost with a dead driver: their top-ups are extra


@dataclass(frozen=True, kw_only=True)
class InFlightExecution:
    """An execution of a group that was in rollout when the driver died, as the resumed
    run finds it: ``running`` (its harness outlived the driver: it is adopted),
    ``finished`` (it ended and counted before, with its valid ``reward`` or None), or
    neither: lost before it could end (it is replaced)."""

    id: int
    index: int
    version: int
    running: bool = False
    finished: bool = False
    reward: float | None = None


@dataclass(frozen=True, kw_only=True)
class InFlightGroup:
    """A group that was in rollout when the driver died, with every execution it had."""

    id: int
    v_d: int
    executions: tuple[InFlightExecution, ...]


@dataclass(frozen=True, kw_only=True)
class ReadyGroup:
    """A group that finished its rollout and was not trained when the driver died:
    its version at dispatch and the valid rewards it was admitted with."""

    id: int
    v_d: int
    valid: Mapping[int, float] = field(default_factory=dict)  # execution id -> reward


@dataclass(frozen=True)
class Consumed:
    """A group assigned to training step ``v_t``; it was admitted at version ``v_d``."""

    group_id: int
    v_d: int
    v_t: int

    @property
    def staleness(self) -> int:
        """Scheduling staleness d = v_t - v_d (docs/design.md §1)."""
        return self.v_t - self.v_d


@dataclass(kw_only=True)
class Execution:
    """One execution; ``version`` is the published version it launched with (a top-up
    launched after a publication samples newer weights than its group's v_d)."""

    id: int
    group: int
    index: int
    engine: int | None = None  # None while queued
    finished: bool = False
    version: int | None = None  # None while queued


@dataclass(frozen=True)
class Counters:
    """d, p, f (docs/design.md §2) and the replacement reserve held, all in executions.

    ``reserved`` = min(reserve left in this burst, top-ups the groups in rollout may still
    get): quota that top-ups may still take within the burst (0 once rollout is done).
    It is part of the waterlevel that Eqs 5 and 6 compare with room.
    """

    dispatched: int
    launched: int
    finished: int
    reserved: int = 0

    @property
    def queued(self) -> int:
        return self.dispatched - self.launched

    @property
    def running(self) -> int:
        return self.launched - self.finished

    @property
    def waterlevel(self) -> int:
        """w = d - f + reserved; never rises within a burst under boundary dispatch."""
        return self.dispatched - self.finished + self.reserved


class Scheduler:
    """The elastic scheduler; see the module docstring for the contract."""

    def __init__(self, params: SchedulerParams) -> None:
        self.params = params
        k = params.cells
        if params.policy == "elastic":
            self.units: list[tuple[int, ...]] = [(i,) for i in range(k)]
        elif params.policy == "colocate":
            self.units = [tuple(range(k))]
        else:
            self.units = []
        self.roles = [Role.ROLLOUT] * k  # read-only: only _set_role changes a role
        self._role_counts = {role: 0 for role in Role} | {Role.ROLLOUT: k}
        self._training: set[int] = set()  # cells in Role.TRAINING
        self._training_view: tuple[int, ...] | None = ()  # sorted _training, None when stale
        self._units_joined = 0  # units whose lead cell trains (they join in prefix order)
        self._leads: set[int] = set()  # each unit's first cell
        self._cells_from: list[int] = []  # cells in units[n:], by n
        self._spare = 0  # cells that serve rollout for good: in no unit, not lost
        # async: cells 0.._fixed_training-1 train for good (fewer after a loss)
        self._fixed_training = params.async_training_cells if params.policy == "async" else 0
        self._cut_units(k)
        # Rollout cells that may have room, as a heap of -cell (the highest index first);
        # every rollout cell with room is in it, stale entries are dropped when met.
        self._room = [-cell for cell in reversed(range(k))]
        self._in_room = set(range(k))
        self._return_after_move: set[int] = set()  # ordered back while moving to training
        self._parked: dict[int, int] = {}  # execution -> the lost cell it ran on: no engine
        self.groups: dict[int, Group] = {}
        self.executions: dict[int, Execution] = {}
        self._queue: deque[int] = deque()
        self._load: dict[int, set[int]] = {e: set() for e in [STANDALONE, *range(k)]}
        self._ready: list[tuple[int, int, int]] = []  # heap of (v_d, ready seq, group id)
        self._ready_seq = 0
        self._rollout: set[int] = set()  # groups in ROLLOUT
        self._owing: set[int] = set()  # groups in ROLLOUT with top-ups owed
        self._topups_open = 0  # sum of _topups_left over the groups in ROLLOUT
        self._dropped_in_burst = 0  # boundary: drops whose slots wait for the boundary
        self._next_group = self._next_execution = 0
        self._resumed: list[int] = []  # in-flight groups of a resumed run, until Start
        self._d = self._p = self._f = 0
        self._reserve_left = 0  # of the burst's replacement reserve (boundary dispatch)
        self.version = 0  # optimizer steps done
        self.published = 0  # latest published version
        self.core_kept = 0  # publications after which Eq 6 kept the core unit in training
        self.stalls = 0  # stalled bursts' mid-burst dispatches: the only rises of w in a burst
        self._batch: list[int] = []  # groups assigned to the current step
        self._wanted = 0  # groups the packing buffer asked for and has not received
        self._steps_in_burst = 0
        self._publishing = False
        self._started = False
        self._supply_since: float | None = None
        self._wake_at: float | None = None
        self._now = 0.0
        self._out: list[Action] = []

    # ------------------------------------------------------------ read-only views

    @property
    def counters(self) -> Counters:
        held = min(self._reserve_left, self._topups_open)
        return Counters(self._d, self._p, self._f, held)

    @property
    def capacity(self) -> int:
        """Eq 3: rollout capacity of the engines that serve now."""
        serving = self._role_counts[Role.ROLLOUT]
        return serving * self.params.cell_capacity + self.params.standalone_capacity

    @property
    def training_cells(self) -> tuple[int, ...]:
        """Cells whose transition to training is done (they may claim micro-steps)."""
        if self._training_view is None:
            self._training_view = tuple(sorted(self._training))
        return self._training_view

    @property
    def ready_unassigned(self) -> int:
        return len(self._ready)

    @property
    def batch_needs(self) -> int:
        """Groups the current step's batch still needs (0 while publishing)."""
        return 0 if self._publishing else self.params.batch - len(self._batch)

    @property
    def publishing(self) -> bool:
        return self._publishing

    def wants_groups(self, queued_micro_steps: int) -> bool:
        """Whether the packing buffer should pull one more group (:class:`PullGroups`).

        Only when fewer unclaimed micro-steps wait than cells train, so that ready
        groups stay unassigned -- and count as supply for the next cell's join -- until
        the training cells can actually use them.
        """
        return (
            self.batch_needs > 0
            and self._wanted == 0
            and self.ready_unassigned > 0
            and queued_micro_steps < len(self._training)
        )

    def consumed(self) -> list[Consumed]:
        """Groups assigned to a training step, in group id order."""
        return [Consumed(g.id, g.v_d, g.v_t) for g in self.groups.values() if g.v_t is not None]

    def running_on(self, engine: int) -> frozenset[int]:
        return frozenset(self._load[engine])

    def resume(
        self,
        version: int,
        ready: Sequence[ReadyGroup],
        *,
        next_group: int,
        next_execution: int,
        in_flight: Sequence[InFlightGroup] = (),
    ) -> None:
        """Before :class:`Start`: continue a run whose optimizer has made ``version``
        updates (all published), with the groups that finished their rollout and were
        not trained yet, in the order they became ready. New groups and executions get ids from
        ``next_group`` / ``next_execution`` on, so they never reuse the old run's ids.

        ``in_flight``: the groups that were in rollout. At :class:`Start` their running
        executions are placed on engines (:class:`Adopt`, standalone first, then the
        rollout cells with room, else the least loaded), their finished ones keep their
        rewards, and a lost one is replaced by a top-up that does not count against
        ``groups.max_topups`` (as many as the group still needs). Queued executions of
        the old run are gone; their slots refill.
        """
        if self._started:
            raise SchedulerError("resume() must come before Start")
        if version < 0 or next_group < 0 or next_execution < 0:
            raise SchedulerError("resume() needs non-negative version and ids")
        gids = [g.id for g in ready] + [g.id for g in in_flight]
        if any(gid >= next_group for gid in gids) or len(set(gids)) != len(gids):
            raise SchedulerError(
                f"resumed group ids must be distinct and below next_group={next_group}"
            )
        eids = [e.id for g in in_flight for e in g.executions]
        if any(eid >= next_execution for eid in eids) or len(set(eids)) != len(eids):
            raise SchedulerError(
                f"resumed execution ids must be distinct and below next_execution={next_execution}"
            )
        self.version = self.published = version
        self._next_group, self._next_execution = next_group, next_execution
        for r in ready:
            self.groups[r.id] = Group(
                id=r.id, v_d=r.v_d, state=GroupState.READY, valid=dict(r.valid)
            )
            heapq.heappush(self._ready, (r.v_d, self._ready_seq, r.id))
            self._ready_seq += 1
        for resumed in in_flight:
            group = Group(id=resumed.id, v_d=resumed.v_d)
            for e in sorted(resumed.executions, key=lambda e: e.index):
                ex = Execution(id=e.id, group=group.id, index=e.index, version=e.version)
                ex.finished = not e.running
                self.executions[ex.id] = ex
                group.executions.append(ex.id)
                if e.running:
                    group.pending.add(ex.id)
                elif e.finished and e.reward is not None:
                    group.valid[ex.id] = e.reward
                elif not e.finished:
                    group.replaced += 1
            self.groups[group.id] = group
            self._rollout.add(group.id)
            self._topups_open += self._topups_left(group)
            self._resumed.append(group.id)

    # ------------------------------------------------------------ the one entry point

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions to carry out, in order."""
        if event.time < self._now:
            raise SchedulerError(f"event time {event.time} is before {self._now}")
        if not self._started and not isinstance(event, Start):
            raise SchedulerError(f"{type(event).__name__} before Start")
        before = self._now
        self._now = event.time
        self._out = []
        try:
            self._apply(event)
        except SchedulerError:
            self._now = before  # every handler validates before it changes anything
            raise
        self._settle()
        return self._out

    def _apply(self, event: Event) -> None:
        match event:
            case Start():
                self._on_start()
            case ExecutionFinished():
                self._on_finished(event)
            case CellMoved():
                self._on_cell_moved(event.cell)
            case CellLost():
                self._on_cell_lost(event.cell)
            case StepDone():
                self._on_step_done(event.step)
            case PublicationDone():
                self._on_publication_done(event.version)
            case PullGroups():
                if event.step != self.version or event.count < 0:
                    raise SchedulerError(
                        f"PullGroups for step {event.step}, count {event.count}"
                        f" (current step {self.version})"
                    )
                self._wanted = event.count
            case Tick():
                if self._wake_at is not None and self._now >= self._wake_at:
                    self._wake_at = None

    # ------------------------------------------------------------ event handlers

    def _on_start(self) -> None:
        if self._started:
            raise SchedulerError("Start received twice")
        self._started = True
        for cell in range(self._fixed_training):
            self._set_role(cell, Role.TRAINING)
        self._adopt_resumed()
        self._boundary()

    def _adopt_resumed(self) -> None:
        """A resumed run's in-flight groups (:meth:`resume`): running executions are
        placed on engines, then each group is ready, or tops up what it still needs."""
        groups = [self.groups[gid] for gid in self._resumed]
        self._resumed = []
        for group in groups:
            for eid in sorted(group.pending):
                ex = self.executions[eid]
                engine = self._free_engine()
                if engine is None:
                    engine = self._least_loaded()
                if engine is None:  # at Start every cell not fixed in training serves
                    raise SchedulerError(f"no engine serves adopted execution {eid}")
                ex.engine = engine
                self._load[engine].add(eid)
                self._d += 1
                self._p += 1
                version = self.published if ex.version is None else ex.version
                self._out.append(Adopt(eid, group.id, ex.index, ex.engine, version))
        for group in groups:
            done = not group.pending and len(group.valid) >= self.params.valid_needed
            if len(group.valid) >= self.params.group_size or done:
                self._make_ready(group)
            else:
                self._top_up_or_drop(group)

    def _on_finished(self, event: ExecutionFinished) -> None:
        ex = self.executions.get(event.execution_id)
        if ex is None or ex.engine is None:
            raise SchedulerError(f"execution {event.execution_id} was never launched")
        if ex.finished:
            raise SchedulerError(f"execution {event.execution_id} finished twice")
        if event.outcome is Outcome.CANCELLED and event.reward is not None:
            raise SchedulerError("a cancelled execution cannot carry a reward")
        ex.finished = True
        self._f += 1
        self._load[ex.engine].discard(ex.id)
        self._parked.pop(ex.id, None)
        if ex.engine != STANDALONE:
            self._offer_room(ex.engine)
        group = self.groups[ex.group]
        if ex.id not in group.pending:
            return  # surplus that was cancelled, or part of a dropped group
        group.pending.discard(ex.id)
        if group.state is not GroupState.ROLLOUT:
            return
        if event.reward is not None:
            group.valid[ex.id] = event.reward
        if len(group.valid) >= self.params.group_size:
            self._make_ready(group)
        elif not group.pending and len(group.valid) >= self.params.valid_needed:
            self._make_ready(group)  # every execution is done: train on the valid ones
        else:
            self._top_up_or_drop(group)

    def _on_cell_moved(self, cell: int) -> None:
        if not 0 <= cell < len(self.roles):
            raise SchedulerError(f"cell {cell} does not exist (0..{len(self.roles) - 1})")
        role = self.roles[cell]
        if role is Role.TO_TRAINING:
            self._set_role(cell, Role.TRAINING)
            self._supply_since = None  # the timer resets after each transition
            if cell in self._return_after_move:  # its burst ended while it was moving
                self._return_after_move.discard(cell)
                self._move(cell, Role.ROLLOUT)
        elif role is Role.TO_ROLLOUT:
            self._set_role(cell, Role.ROLLOUT)
        else:
            raise SchedulerError(f"cell {cell} is not in transition (it is {role})")

    def why_not_lose(self, cell: int) -> str | None:
        """Why :class:`CellLost` for ``cell`` would be refused now, or None if the run
        can go on without it: the core (it holds the optimizer), a lost cell, and a loss
        after which no cell could serve rollout while the core trains (``async``, or
        continuous dispatch whose outstanding executions no longer fit) are refused."""
        p = self.params
        if not 0 <= cell < len(self.roles):
            return f"cell {cell} does not exist (0..{len(self.roles) - 1})"
        if cell == 0 or self.roles[cell] is Role.LOST:
            return (
                f"cell {cell} ({self.roles[cell]}) cannot be lost: only a cell other than the"
                " core that is not lost yet can (the run stops for the core)"
            )
        alive = (c for c, r in enumerate(self.roles) if r is not Role.LOST)
        others = sum(1 for c in alive if c not in (0, cell))
        room = others * p.cell_capacity + p.standalone_capacity
        if p.policy == "async" and room == 0:
            return (
                f"cell {cell} cannot be lost: no engine would be left to serve rollout"
                " (under async the core trains for good)"
            )
        outstanding = p.queue_depth * p.executions_per_group
        if p.dispatch == "continuous" and outstanding > room:
            return (
                f"cell {cell} cannot be lost: continuous dispatch keeps {outstanding}"
                f" executions outstanding, more than the {room} that would fit with the core"
                " in training (Eq 5): it could never train again"
            )
        return None

    def _on_cell_lost(self, cell: int) -> None:
        if (why := self.why_not_lose(cell)) is not None:
            raise SchedulerError(why)
        self._set_role(cell, Role.LOST)  # a switch it was making never ends
        self._return_after_move.discard(cell)
        if self.params.policy == "async":  # cells 0..T-1 train for good: fewer now
            self._fixed_training = min(self._fixed_training, cell)
            for past in range(cell + 1, len(self.roles)):
                if self.roles[past] in (Role.TO_TRAINING, Role.TRAINING):
                    self._move(past, Role.ROLLOUT)
            self._cut_units(cell)
        else:  # the live cells re-form their groups: training is a prefix of them
            self._cut_units(len(self.roles), without=cell)
        self._parked.update({eid: cell for eid in self._load[cell]})
        self._load[cell].clear()

    def _serving_soon(self) -> bool:
        """An engine serves rollout, or a cell is on its way back to rollout."""
        counts = self._role_counts
        return bool(
            self.params.standalone_capacity
            or counts[Role.ROLLOUT]
            or counts[Role.TO_ROLLOUT]
            or self._return_after_move
        )

    def _keep_an_engine(self) -> None:
        """No engine serves or is on its way while executions wait for one (after a
        loss): the newest unit in training returns to rollout (under ``async``, the
        highest training cell other than the core, for good)."""
        if self._serving_soon() or not (self._parked or self._queue):
            return
        moving_in = (Role.TRAINING, Role.TO_TRAINING)
        newest = max((c for c, r in enumerate(self.roles) if r in moving_in), default=0)
        if self.params.policy == "async":
            self._fixed_training = newest  # why_not_lose kept a cell other than the core
            self._cut_units(len(self.roles))
            self._move(newest, Role.ROLLOUT)
            return
        for cell in next(unit for unit in self.units if newest in unit):
            self._move(cell, Role.ROLLOUT)

    def _unpark(self) -> None:
        """Executions of lost cells go to the engines that serve, ones with room first."""
        for eid in sorted(self._parked):
            destination = self._free_engine()
            if destination is None:
                destination = self._least_loaded()
            if destination is None:
                return  # nothing serves yet: they wait
            self._reroute(eid, self._parked.pop(eid), destination)

    def _cut_units(self, end: int, without: int | None = None) -> None:
        """Units hold only cells before ``end`` (training stays a prefix), ``without``
        one; the cells in no unit that are not lost serve rollout for good."""
        self.units = [
            cut
            for unit in self.units
            if (cut := tuple(c for c in unit if c < end and c != without))
        ]
        self._leads = {unit[0] for unit in self.units}
        sizes = [len(unit) for unit in self.units]
        self._cells_from = [*itertools.accumulate(reversed(sizes), initial=0)][::-1]
        in_units = set(itertools.chain.from_iterable(self.units))
        self._spare = sum(
            1
            for c, role in enumerate(self.roles)
            if c not in in_units and role is not Role.LOST and c >= self._fixed_training
        )

    def _on_step_done(self, step: int) -> None:
        if step != self.version or len(self._batch) < self.params.batch:
            raise SchedulerError(
                f"StepDone({step}) but step {self.version} has"
                f" {len(self._batch)}/{self.params.batch} groups assigned"
            )
        for gid in self._batch:
            self.groups[gid].state = GroupState.TRAINED
        self.version += 1
        self._steps_in_burst += 1
        self._batch = []
        self._wanted = 0
        self._supply_since = None  # the timer resets at each batch start
        if self._steps_in_burst == self.params.mu:
            self._end_burst()

    def _end_burst(self) -> None:
        """After the burst's last optimizer update: satellites return, the core publishes."""
        self._steps_in_burst = 0
        self._publishing = True
        for unit in self.units[1:]:
            for cell in unit:
                self._move(cell, Role.ROLLOUT)
        self._out.append(Publish(self.version))

    def _on_publication_done(self, version: int) -> None:
        if not self._publishing or version != self.version:
            raise SchedulerError(f"PublicationDone({version}) was not asked for")
        self._publishing = False
        self.published = version
        self._boundary()
        if self.units and self.roles[self.units[0][0]] is not Role.ROLLOUT:
            self._core_stays_or_returns()

    # ------------------------------------------------------------ rules

    def _settle(self) -> None:
        """After every event: assign ready groups, unblock a stalled burst, move cells,
        launch (Eqs 4-5)."""
        self._assign_ready()
        self._unstall()
        self._keep_an_engine()
        self._maybe_join()
        self._unpark()
        self._launch()

    def _boundary(self) -> None:
        """At Start and after each publication: owed top-ups first, then Eq 1 (or the
        continuous slot rule) refills the queue depth; the burst's reserve is renewed."""
        self._dispatch_owed()
        self._refill()
        self._dropped_in_burst = 0
        self._reserve_left = self.params.reserve

    def _dispatch_owed(self) -> None:
        """Owed top-ups enter the queue ahead of everything, oldest group first."""
        ids: list[int] = []
        for gid in sorted(self._owing):
            group = self.groups[gid]
            n = group.owed
            self._set_owed(group, 0)
            ids += self._dispatch(group, n, topup=True)
        self._owing.clear()
        # Each group's top-ups jumped ahead of the previous group's: restore id order.
        for _ in ids:
            self._queue.popleft()
        self._queue.extendleft(reversed(ids))

    def _stalled(self) -> bool:
        """Boundary dispatch: the groups this burst holds can no longer fill the current
        step (ready + non-short groups in rollout < what the step still needs)."""
        if self.params.dispatch != "boundary":
            return False
        supply = len(self._ready) + len(self._rollout) - len(self._owing)
        return supply < self.batch_needs

    def _unstall(self) -> None:
        """A stalled burst ends early if it trained a step and the current step holds no
        group yet; otherwise the owed top-ups and the dropped slots are dispatched now."""
        if not self._stalled():
            return
        if self._steps_in_burst and not self._batch:
            self._end_burst()
            return
        dispatched = self._d
        self._dispatch_owed()
        for _ in range(self._dropped_in_burst):
            self._dispatch_group()
        self._dropped_in_burst = 0
        if self._d > dispatched:
            self.stalls += 1

    def _refill(self) -> None:
        """Eq 1 (boundary) or the continuous slot rule: dispatch up to the queue depth."""
        for _ in range(self.params.queue_depth - self._slots_held()):
            self._dispatch_group()

    def _slots_held(self) -> int:
        """Boundary: a group holds its slot until trained. Continuous: until ready."""
        held = len(self._rollout)  # ROLLOUT groups; READY ones are _ready, ASSIGNED _batch
        if self.params.dispatch == "boundary":
            held += len(self._ready) + len(self._batch)
        return held

    def _dispatch_group(self) -> None:
        group = Group(id=self._next_group, v_d=self.published)
        self._next_group += 1
        self.groups[group.id] = group
        self._rollout.add(group.id)
        self._topups_open += self._topups_left(group)
        self._dispatch(group, self.params.executions_per_group, topup=False)

    def _dispatch(self, group: Group, n: int, topup: bool) -> list[int]:
        """Dispatch ``n`` executions of ``group`` (in rollout): a new group's join the back
        of the queue; top-ups jump it (their group is already waiting on them)."""
        left = self._topups_left(group)
        ids = []
        for _ in range(n):
            # past the last index (a resumed group may miss some: never launched)
            last = self.executions[group.executions[-1]].index if group.executions else -1
            ex = Execution(id=self._next_execution, group=group.id, index=last + 1)
            self._next_execution += 1
            self.executions[ex.id] = ex
            group.executions.append(ex.id)
            group.pending.add(ex.id)
            ids.append(ex.id)
        if topup:
            self._queue.extendleft(reversed(ids))
        else:
            self._queue.extend(ids)
        self._d += n
        self._topups_open += self._topups_left(group) - left
        self._out.append(Dispatch(group.id, tuple(ids), self.published, topup=topup))
        return ids

    def _make_ready(self, group: Group) -> None:
        """N valid rewards: the group is ready; its surplus executions are cancelled."""
        self._leave_rollout(group, GroupState.READY)
        heapq.heappush(self._ready, (group.v_d, self._ready_seq, group.id))
        self._ready_seq += 1
        self._cancel_pending(group)
        if self.params.dispatch == "continuous":
            self._dispatch_group()

    def _topups_left(self, group: Group) -> int:
        """Top-ups ``group`` may still get (its ``max_topups`` allowance, owed ones spent)."""
        p = self.params
        allowed = p.executions_per_group + p.max_topups + group.replaced
        return max(0, allowed - len(group.executions) - group.owed)

    def _set_owed(self, group: Group, owed: int) -> None:
        """Change the top-ups ``group`` (in rollout) is owed; keeps ``_topups_open``."""
        left = self._topups_left(group)
        group.owed = owed
        self._topups_open += self._topups_left(group) - left

    def _leave_rollout(self, group: Group, state: GroupState) -> None:
        """``group`` is ready or dropped: it no longer counts as in rollout."""
        self._topups_open -= self._topups_left(group)
        self._rollout.discard(group.id)
        group.state = state

    def _top_up_or_drop(self, group: Group) -> None:
        """Replace executions without a valid reward; drop the group past the allowance.

        Continuous dispatch: top-ups, or the dropped group's replacement, at once.
        Boundary dispatch: top-ups out of the burst's reserve at once, the rest owed to
        the next boundary; a dropped group's slot waits for the boundary's refill.
        """
        p = self.params
        shortfall = p.valid_needed - len(group.valid) - len(group.pending) - group.owed
        if shortfall <= 0:
            return
        if shortfall > self._topups_left(group):
            self._drop(group)
        elif p.dispatch == "continuous":
            self._dispatch(group, shortfall, topup=True)
        else:
            now = min(shortfall, self._reserve_left)
            self._reserve_left -= now
            if now:
                self._dispatch(group, now, topup=True)
            if shortfall > now:
                self._set_owed(group, group.owed + shortfall - now)
                self._owing.add(group.id)

    def _drop(self, group: Group) -> None:
        self._leave_rollout(group, GroupState.DROPPED)
        group.owed = 0
        self._owing.discard(group.id)
        self._cancel_pending(group)
        self._out.append(DropGroup(group.id))
        if self.params.dispatch == "continuous":
            self._dispatch_group()
        else:
            self._dropped_in_burst += 1

    def _cancel_pending(self, group: Group) -> None:
        for eid in sorted(group.pending):
            ex = self.executions[eid]
            if ex.engine is None:  # still queued: withdraw, it never launches
                self._queue.remove(eid)
                self._d -= 1
                ex.finished = True
            else:
                self._out.append(Cancel(eid))
        group.pending.clear()

    def _assign_ready(self) -> None:
        """Ready groups join the current batch, oldest version first.

        Streaming: as many as the packing buffer wants. Not streaming: the whole
        remainder of the batch at once, once it is all ready.
        """
        needs = self.batch_needs
        if not needs or not self._ready or not self._training:
            return
        if self.params.streaming:
            n = min(self._wanted, needs, len(self._ready))
        else:
            n = needs if len(self._ready) >= needs else 0
        if n == 0:
            return
        self._wanted = max(0, self._wanted - n)
        take = [heapq.heappop(self._ready)[2] for _ in range(n)]
        for gid in take:
            self.groups[gid].state = GroupState.ASSIGNED
            self.groups[gid].v_t = self.version
        self._batch += take
        closes = len(self._batch) == self.params.batch
        self._out.append(AssignGroups(self.version, tuple(take), closes_batch=closes))

    def _supply_ok(self) -> bool:
        """The supply check (Eq 5): ready-unassigned groups capped by the batch's need,
        plus (``supply="in_hand"``) the groups already assigned to the batch, whose
        training is work a joining cell can share."""
        available = min(self.ready_unassigned, self.batch_needs)
        if self.params.supply == "in_hand" and not self._publishing:
            available += len(self._batch)
        return available >= self.params.rho_min * self.params.batch

    def _capacity_with_units_training(self, n_units: int) -> int:
        serving = self._cells_from[n_units] + self._spare  # units[n_units:], and the rest
        return serving * self.params.cell_capacity + self.params.standalone_capacity

    def _maybe_join(self) -> None:
        """Eq 5 plus the supply check held for tau: the next unit joins training."""
        if not self.units or self._publishing:
            self._supply_since = None
            return
        if self._role_counts[Role.TO_TRAINING] or self._role_counts[Role.TO_ROLLOUT]:
            return  # cells move serially
        joined = self._units_joined
        if joined == len(self.units):
            return
        if not self._supply_ok():
            self._supply_since = None
            return
        if self._supply_since is None:
            self._supply_since = self._now
        w = self.counters.waterlevel
        if w > self._capacity_with_units_training(joined + 1):
            return
        due = self._supply_since + self.params.tau_s
        if self._now < due:
            if self._wake_at is None or self._wake_at > due:
                self._wake_at = due
                self._out.append(WakeAt(due))
            return
        self._join(self.units[joined])

    def _join(self, unit: tuple[int, ...]) -> None:
        """Move a unit to training: stop accepting, reroute its executions, switch."""
        for cell in unit:
            self._move(cell, Role.TRAINING)
        for cell in unit:
            for eid in sorted(self._load[cell]):
                destination = self._free_engine()
                if destination is None:  # Eq 5 guarantees room; a failure is a bug here
                    raise AssertionError(f"no rollout capacity to reroute execution {eid}")
                self._reroute(eid, cell, destination)
        self._supply_since = None

    def _reroute(self, eid: int, source: int, destination: int) -> None:
        self._load[source].discard(eid)
        self._load[destination].add(eid)
        self.executions[eid].engine = destination
        self._out.append(Reroute(eid, source, destination))

    def _least_loaded(self) -> int | None:
        """The serving engine with the fewest executions for its capacity (for a lost
        cell's executions when no engine has room); None when none serves."""
        engines = [c for c, role in enumerate(self.roles) if role is Role.ROLLOUT]
        if self.params.standalone_capacity:
            engines.append(STANDALONE)
        if not engines:
            return None

        def fill(engine: int) -> float:
            room = self.params.standalone_capacity if engine == STANDALONE else None
            return len(self._load[engine]) / (room or self.params.cell_capacity)

        return min(engines, key=fill)

    def _core_stays_or_returns(self) -> None:
        """Eq 6: the core unit stays in training for the next burst, or returns."""
        stays = self.ready_unassigned >= self.params.rho_min * self.params.batch and (
            self.counters.waterlevel <= self._capacity_with_units_training(1)
        )
        if stays:
            self.core_kept += 1
        else:
            for cell in self.units[0]:
                self._move(cell, Role.ROLLOUT)

    def _move(self, cell: int, role: Role) -> None:
        """Order a move; a cell still moving to training finishes that move first.

        Idempotent: a cell already in (or moving to) ``role`` gets no second order.
        """
        current = self.roles[cell]
        if current in (
            (Role.ROLLOUT, Role.TO_ROLLOUT)
            if role is Role.ROLLOUT
            else (Role.TRAINING, Role.TO_TRAINING)
        ):
            return
        if role is Role.ROLLOUT and current is Role.TO_TRAINING:
            self._return_after_move.add(cell)
            return
        self._set_role(cell, Role.TO_TRAINING if role is Role.TRAINING else Role.TO_ROLLOUT)
        self._out.append(MoveCell(cell, role))

    def _set_role(self, cell: int, role: Role) -> None:
        """The one place a role changes; keeps the tallies the rules read per event."""
        old = self.roles[cell]
        if old is role:
            return
        self.roles[cell] = role
        self._role_counts[old] -= 1
        self._role_counts[role] += 1
        if Role.TRAINING in (old, role):
            self._training_view = None
            lead = 1 if cell in self._leads else 0
            if role is Role.TRAINING:
                self._training.add(cell)
                self._units_joined += lead
            else:
                self._training.discard(cell)
                self._units_joined -= lead
        if role is Role.ROLLOUT:
            self._offer_room(cell)

    def _offer_room(self, cell: int) -> None:
        """``cell`` may have room now: it serves rollout again, or an execution on it ended."""
        if cell not in self._in_room:
            self._in_room.add(cell)
            heapq.heappush(self._room, -cell)

    def _free_engine(self) -> int | None:
        """The preferred engine with room: standalone first, then the rollout cell with the
        highest index (it stays in rollout longest); None when all are full."""
        if len(self._load[STANDALONE]) < self.params.standalone_capacity:
            return STANDALONE
        while self._room:
            cell = -self._room[0]
            has_room = len(self._load[cell]) < self.params.cell_capacity
            if has_room and self.roles[cell] is Role.ROLLOUT:
                return cell
            heapq.heappop(self._room)
            self._in_room.discard(cell)
        return None

    def _launch(self) -> None:
        """Eq 4: launch ``min(d - p, C(t) - (p - f))`` queued executions."""
        while self._queue and (engine := self._free_engine()) is not None:
            ex = self.executions[self._queue.popleft()]
            ex.engine = engine
            self._load[engine].add(ex.id)
            ex.version = self.published
            self._p += 1
            self._out.append(Launch(ex.id, ex.group, ex.index, engine, self.published))
