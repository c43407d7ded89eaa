"""A discrete-event simulator that drives the real :class:`Scheduler` with a virtual clock.

The simulator plays every part the scheduler does not: executions take the time
their workload says, cells take the paper's switch costs to move, training is a
queue of micro-steps that training cells claim one at a time, and publication
takes ``publish_s``. Its heart is the same loop the live runtime runs::

    for action in scheduler.handle(event):
        execute(action)

Training cost model: a group contributes the ``train_tokens`` of its N counted
executions; those tokens are cut into micro-steps of ``micro_step_tokens`` and a
training cell processes one micro-step at ``train_tokens_per_cell_s``. A step ends
``train_step_overhead_s`` after its last micro-step (pipeline drain, gradient
aggregation and the optimizer update). Default calibration: on the paper-122b
workload (~100k selected tokens per execution) one step's training then costs
about a fifth of the cell-hours its rollouts take — the paper's E0 reports that
rollout hides training with 20.85% slack — i.e. ~10k tokens/s for a 4-node cell.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from qwengyre.config import Config
from qwengyre.scheduler.core import Scheduler, SchedulerParams
from qwengyre.scheduler.events import (
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
from qwengyre.scheduler.staleness import predicted_staleness, steady_steps
from qwengyre.sim.bound import RunBound, run_bound, run_work
from qwengyre.sim.workload import ExecutionSpec, Workload
from qwengyre.types import Outcome


@dataclass(frozen=True, kw_only=True)
class SimCosts:
    """Time costs of everything outside rollout (seconds), from the config tree
    (:meth:`from_config`: the one place their defaults are declared)."""

    rollout_to_training_s: float  # cells.rollout_to_training_s
    training_to_rollout_s: float  # cells.training_to_rollout_s
    publish_s: float  # sim.publish_s
    train_tokens_per_cell_s: float  # sim.train_tokens_per_cell_s
    train_step_overhead_s: float  # sim.train_step_overhead_s
    micro_step_tokens: int  # sim.micro_step_tokens

    @classmethod
    def from_config(cls, config: Config) -> SimCosts:
        return cls(
            rollout_to_training_s=config.cells.rollout_to_training_s,
            training_to_rollout_s=config.cells.training_to_rollout_s,
            publish_s=config.sim.publish_s,
            train_tokens_per_cell_s=config.sim.train_tokens_per_cell_s,
            train_step_overhead_s=config.sim.train_step_overhead_s,
            micro_step_tokens=config.sim.micro_step_tokens,
        )

    def micro_step_s(self, tokens: float) -> float:
        return tokens / self.train_tokens_per_cell_s


@dataclass(frozen=True)
class RoleSpan:
    """Cell ``cell`` held ``role`` from ``start_s`` to ``end_s``."""

    cell: int
    role: Role
    start_s: float
    end_s: float


@dataclass(frozen=True)
class LoadSample:
    """Running and queued executions and rollout capacity from ``time_s`` on."""

    time_s: float
    running: int
    queued: int
    capacity: int


@dataclass(kw_only=True)
class SimResult:
    """What one simulated run measured.

    ``mean_staleness`` is Eq 2's quantity over the steady-state steps: v_t - v_d, each
    consumed group counted once. ``mean_execution_staleness`` averages, over the counted
    executions of the same groups, v_t minus the version the execution launched with
    (:attr:`Launch.version`): lower when top-ups launched after a later publication.
    ``bound`` is this run's lower bound on ``end_to_end_s`` (:mod:`qwengyre.sim.bound`).
    ``core_kept`` of the run's ``publications`` ended with Eq 6 keeping the core unit in
    training for the next burst (always 0 for async, whose split never moves).
    ``stalls`` counts bursts that dispatched mid-burst because their groups could no
    longer fill a step (:attr:`Scheduler.stalls`): the only rises of w within a burst.
    """

    policy: str
    mu: int
    phi: float
    steps: int
    end_to_end_s: float
    step_end_s: list[float]
    mean_staleness: float
    mean_staleness_all: float
    predicted_staleness: float
    mean_execution_staleness: float
    bound: RunBound
    cell_training_share: list[float]
    rollout_utilisation: float
    launched: int
    cancelled: int
    groups_dropped: int
    reroutes: int
    publications: int
    core_kept: int
    stalls: int
    role_spans: list[RoleSpan] = field(repr=False)
    load: list[LoadSample] = field(repr=False)

    @property
    def step_times_s(self) -> list[float]:
        """Duration of each step, from the previous step's end (the first from 0)."""
        return [b - a for a, b in zip([0.0, *self.step_end_s], self.step_end_s, strict=False)]

    def summary(self) -> dict[str, object]:
        """The JSON-ready fields of ``qwengyre simulate --json``."""
        return {
            "policy": self.policy,
            "mu": self.mu,
            "phi": self.phi,
            "steps": self.steps,
            "end_to_end_s": self.end_to_end_s,
            "step_times_s": self.step_times_s,
            "mean_staleness": self.mean_staleness,
            "mean_staleness_all_steps": self.mean_staleness_all,
            "predicted_staleness": self.predicted_staleness,
            "mean_execution_staleness": self.mean_execution_staleness,
            "lower_bound_s": self.bound.seconds,
            "lower_bound_terms_s": self.bound.terms(),
            "lower_bound_binding": self.bound.binding,
            "time_over_bound": self.end_to_end_s / self.bound.seconds,
            "cell_training_share": self.cell_training_share,
            "rollout_utilisation": self.rollout_utilisation,
            "executions_launched": self.launched,
            "executions_cancelled": self.cancelled,
            "groups_dropped": self.groups_dropped,
            "reroutes": self.reroutes,
            "publications": self.publications,
            "eq6_core_kept": self.core_kept,
            "stalled_dispatches": self.stalls,
        }


# Internal timer kinds, ordered so that simultaneous events resolve deterministically.
_FINISH, _CELL, _MICRO, _STEP, _PUBLISH, _TICK = range(6)


class Simulation:
    """One run of one policy on one workload; call :meth:`run` once. ``scheduler``: the
    one to drive, a new one of ``params`` by default (a test passes one that records)."""

    def __init__(
        self,
        params: SchedulerParams,
        costs: SimCosts,
        workload: Workload,
        steps: int,
        *,
        scheduler: Scheduler | None = None,
    ) -> None:
        if scheduler is not None and scheduler.params != params:
            raise ValueError("the scheduler to drive must have the simulation's params")
        self.params, self.costs, self.steps = params, costs, steps
        self.workload = workload
        self.scheduler = Scheduler(params) if scheduler is None else scheduler
        self.now = 0.0
        self._timers: list[tuple[float, int, int, int]] = []  # (time, kind, seq, payload)
        self._seq = 0
        self._specs: dict[int, ExecutionSpec] = {}
        self._launch_version: dict[int, int] = {}  # execution -> version it launched with
        self._finish_timer: dict[int, int] = {}  # execution -> seq of its live finish timer
        self._cancelled: set[int] = set()
        self._micro: deque[float] = deque()  # token counts of unclaimed micro-steps
        self._busy: set[int] = set()  # cells working on a micro-step (they may have left training)
        self._idle: set[int] = set()  # training cells not working on a micro-step
        self._batch_closed = False
        self._step_pending = False
        self.step_end_s: list[float] = []
        self.launched = self.cancelled = self.dropped = self.reroutes = self.publications = 0
        self._roles = list(self.scheduler.roles)  # as last observed
        self._touched = set(range(params.cells))  # cells whose role may have changed since
        self._role_since = [0.0] * params.cells
        self.role_spans: list[RoleSpan] = []
        self.load: list[LoadSample] = []

    # ------------------------------------------------------------ driver loop

    def run(self) -> SimResult:
        self._deliver(Start(0.0))
        while self.scheduler.version < self.steps:
            if not self._timers:
                raise RuntimeError(
                    f"simulation stalled at t={self.now:.0f}s after"
                    f" {self.scheduler.version} steps (nothing left to happen)"
                )
            time, kind, seq, payload = heapq.heappop(self._timers)
            self.now = time
            event = self._fire(kind, seq, payload)
            if event is None:
                self._settle()
            else:
                self._deliver(event)
        return self._result()

    def _deliver(self, event: Event) -> None:
        for action in self.scheduler.handle(event):
            self._execute(action)
        self._settle()

    def _settle(self) -> None:
        """After anything happened: we observe roles, cells claim work, the buffer pulls."""
        self._observe_roles()
        self._claim_micro_steps()
        if self.scheduler.wants_groups(len(self._micro)):
            self._deliver(PullGroups(self.now, self.scheduler.version, 1))
        else:
            self._observe_load()

    def _execute(self, action: Action) -> None:
        match action:
            case Launch():
                self._launch(action)
            case Cancel():
                self._cancel(action.execution_id)
            case MoveCell():
                self._touched.add(action.cell)
                to_training = action.role is Role.TRAINING
                c = self.costs
                self._after(
                    c.rollout_to_training_s if to_training else c.training_to_rollout_s,
                    _CELL,
                    action.cell,
                )
            case AssignGroups():
                self._assign(action)
            case Publish():
                self._after(self.costs.publish_s, _PUBLISH, action.version)
            case WakeAt():
                self._after(max(0.0, action.time - self.now), _TICK)
            case Reroute():
                self.reroutes += 1  # calls move transparently; the harness keeps running
            case DropGroup():
                self.dropped += 1
            case Dispatch():
                pass  # the workload is asked at launch

    def _after(self, delay: float, kind: int, payload: int = 0) -> int:
        seq = self._seq
        heapq.heappush(self._timers, (self.now + delay, kind, seq, payload))
        self._seq += 1
        return seq

    def _fire(self, kind: int, seq: int, payload: int) -> Event | None:
        if kind == _FINISH:
            if self._finish_timer.get(payload) != seq:
                return None  # superseded by a cancellation
            del self._finish_timer[payload]
            if payload in self._cancelled:
                return ExecutionFinished(self.now, payload, Outcome.CANCELLED, None)
            spec = self._specs[payload]
            return ExecutionFinished(self.now, payload, spec.outcome, spec.reward)
        if kind == _CELL:
            self._touched.add(payload)
            return CellMoved(self.now, payload)
        if kind == _MICRO:
            self._busy.discard(payload)
            if self._roles[payload] is Role.TRAINING:
                self._idle.add(payload)
            return None
        if kind == _STEP:
            self._step_pending = False
            self._batch_closed = False
            self.step_end_s.append(self.now)
            return StepDone(self.now, payload)
        if kind == _PUBLISH:
            self.publications += 1  # the last step's lies past the run's end: not counted
            return PublicationDone(self.now, payload)
        return Tick(self.now)

    # ------------------------------------------------------------ actions

    def _launch(self, action: Launch) -> None:
        spec = self.workload.execution(action.group_id, action.index)
        self._specs[action.execution_id] = spec
        self._launch_version[action.execution_id] = action.version
        self.launched += 1
        self._finish_timer[action.execution_id] = self._after(
            spec.duration_s, _FINISH, action.execution_id
        )

    def _cancel(self, execution_id: int) -> None:
        """Stopping takes no virtual time, but is reported as its own event."""
        if execution_id in self._finish_timer:
            self._cancelled.add(execution_id)
            self.cancelled += 1
            self._finish_timer[execution_id] = self._after(0.0, _FINISH, execution_id)

    def _assign(self, action: AssignGroups) -> None:
        budget = self.costs.micro_step_tokens
        for gid in action.group_ids:
            tokens = float(
                sum(self._specs[eid].train_tokens for eid in self.scheduler.groups[gid].valid)
            )
            whole, rest = divmod(tokens, budget)
            self._micro.extend([float(budget)] * int(whole) + ([rest] if rest else []))
        self._batch_closed = action.closes_batch

    # ------------------------------------------------------------ training

    def _claim_micro_steps(self) -> None:
        """Idle training cells claim micro-steps, lowest index first; a drained, closed
        batch ends the step."""
        while self._micro and self._idle:
            cell = min(self._idle)
            self._idle.remove(cell)
            self._busy.add(cell)
            self._after(self.costs.micro_step_s(self._micro.popleft()), _MICRO, cell)
        if self._batch_closed and not self._micro and not self._busy and not self._step_pending:
            self._step_pending = True
            self._after(self.costs.train_step_overhead_s, _STEP, self.scheduler.version)

    # ------------------------------------------------------------ observation

    def _observe_roles(self) -> None:
        """Close the spans of cells whose role changed. A role changes only at Start
        (async's training split), by MoveCell and on CellMoved: only those cells are read."""
        roles = self.scheduler.roles
        for cell in sorted(self._touched):
            role = roles[cell]
            if role is self._roles[cell]:
                continue
            self._close_span(cell)
            self._roles[cell] = role
            if role is Role.TRAINING and cell not in self._busy:
                self._idle.add(cell)
            else:
                self._idle.discard(cell)
        self._touched.clear()

    def _observe_load(self) -> None:
        """A load sample when the counts changed (the last one at a time stands)."""
        c = self.scheduler.counters
        counts = (c.running, c.queued, self.scheduler.capacity)
        if self.load and _counts(self.load[-1]) == counts:
            return
        sample = LoadSample(self.now, *counts)
        if self.load and self.load[-1].time_s == self.now:
            self.load[-1] = sample
        else:
            self.load.append(sample)

    def _close_span(self, cell: int) -> None:
        start = self._role_since[cell]
        if self.now > start:
            self.role_spans.append(RoleSpan(cell, self._roles[cell], start, self.now))
        self._role_since[cell] = self.now

    def _result(self) -> SimResult:
        end = self.step_end_s[self.steps - 1]
        for cell in range(self.params.cells):
            self._close_span(cell)
        training = [0.0] * self.params.cells
        for span in self.role_spans:
            if span.role is Role.TRAINING:
                training[span.cell] += min(span.end_s, end) - min(span.start_s, end)
        consumed = [g for g in self.scheduler.consumed() if g.v_t < self.steps]
        steady_range = steady_steps(self.params.mu, self.params.phi, self.steps)
        steady = [g.staleness for g in consumed if g.v_t in steady_range]
        groups = self.scheduler.groups
        per_execution = [
            g.v_t - self._launch_version[eid]
            for g in consumed
            if g.v_t in steady_range
            for eid in groups[g.group_id].valid
        ]
        work = run_work(self.scheduler, self._specs, self.costs, self.steps)
        return SimResult(
            policy=self.params.policy,
            mu=self.params.mu,
            phi=self.params.phi,
            steps=self.steps,
            end_to_end_s=end,
            step_end_s=self.step_end_s[: self.steps],
            mean_staleness=_mean(steady),
            mean_staleness_all=_mean([g.staleness for g in consumed]),
            # Eq 2 describes boundary dispatch; continuous dispatch has no prediction
            predicted_staleness=predicted_staleness(self.params.mu, self.params.phi)
            if self.params.dispatch == "boundary"
            else math.nan,
            mean_execution_staleness=_mean(per_execution),
            bound=run_bound(self.params, self.costs, work),
            cell_training_share=[t / end if end > 0 else 0.0 for t in training],
            rollout_utilisation=_utilisation(self.load, end),
            launched=self.launched,
            cancelled=self.cancelled,
            groups_dropped=self.dropped,
            reroutes=self.reroutes,
            publications=self.publications,
            core_kept=self.scheduler.core_kept,
            stalls=self.scheduler.stalls,
            role_spans=self.role_spans,
            load=self.load,
        )


def _counts(sample: LoadSample) -> tuple[int, int, int]:
    return sample.running, sample.queued, sample.capacity


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else math.nan


def _utilisation(load: list[LoadSample], end: float) -> float:
    """Time-integral of running executions over the time-integral of rollout capacity."""
    used = offered = 0.0
    for sample, nxt in zip(load, [*load[1:], None], strict=False):
        stop = min(end, nxt.time_s if nxt else end)
        if stop <= sample.time_s:
            continue
        used += sample.running * (stop - sample.time_s)
        offered += sample.capacity * (stop - sample.time_s)
    return used / offered if offered else 0.0


def simulate(config: Config, workload: Workload) -> SimResult:
    """Run the scheduler configured by ``config`` on ``workload`` for ``config.sim.steps``."""
    params = config.scheduler_params()
    return Simulation(params, SimCosts.from_config(config), workload, config.sim.steps).run()
