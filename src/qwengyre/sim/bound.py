"""A lower bound on one simulated run's end-to-end time, from the work the run consumed.

T, the end of the run's last step, is at least each of three terms, computed from the
groups the run trained (each with its *counted* executions: the valid rewards it was
trained on, ``Group.valid``), the versions it published, the scheduler's parameters and
the simulator's costs:

- :func:`resource_s`: the cell-seconds the consumed work needs, over the cells;
- :func:`littles_law_s`: the dispatch slots the consumed groups hold (Little's law);
- :func:`critical_chain_s`: the steps one after another, each after its groups are ready.

Each term's docstring proves it from the rules of :mod:`qwengyre.scheduler.core` and
the cost model of :mod:`qwengyre.sim.simulator`, using these facts (o is
``train_step_overhead_s``, p ``publish_s``, S the run's steps, K the cells, C_e and
C_s the cell and standalone capacities, K' the cells that can train at once):

(F1) A cell is in rollout (an engine of C_e slots), in training (one micro-step at a
     time: ``Simulation._claim_micro_steps``) or in transition (neither). No engine runs
     more than its capacity (``Scheduler._launch``, ``_free_engine``). An execution
     that is not cancelled runs exactly its ``duration_s`` from its launch, which comes
     after its group's dispatch; a reroute moves it without restarting it. Counted
     executions carry a reward, so none was cancelled.
(F2) Step s's groups are assigned (``_assign_ready``) only once ready (their counted
     executions finished) and only while ``batch_needs > 0``: after StepDone(s-1) and
     not while publishing. A group's micro-steps exist from its assignment on; they
     total its ``train_tokens`` / ``train_tokens_per_cell_s`` cell-seconds, none longer
     than ``micro_step_tokens`` / rate. The step ends o after its last micro-step
     (``_claim_micro_steps``); in that window no micro-step runs (the batch is full).
(F3) A burst ends (``_end_burst``, which publishes) after at most mu steps
     (``_on_step_done``), at or after its last StepDone; publication takes p and no step
     is assigned before PublicationDone. So each publication of a version v in
     [1, S - 1] lies, whole, between StepDone(v - 1) and step v's first micro-step, and
     at least ceil(S / mu) - 1 of them do. A group with v_d >= 1 was dispatched after
     PublicationDone(v_d) (``published`` is set there).
(F4) The cells each policy keeps out of rollout: :class:`PolicyCells`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwengyre.scheduler.core import Scheduler, SchedulerParams
    from qwengyre.sim.simulator import SimCosts
    from qwengyre.sim.workload import ExecutionSpec


@dataclass(kw_only=True, frozen=True)
class GroupWork:
    """One consumed group: trained in step ``step`` (v_t), dispatched under ``version``
    (v_d); ``longest_s`` (L_g) and ``rollout_s`` are the longest and the summed duration
    of its counted executions, ``train_s`` its micro-steps' cell-seconds and
    ``largest_micro_s`` its longest micro-step."""

    step: int
    version: int
    longest_s: float
    rollout_s: float
    train_s: float
    largest_micro_s: float

    def training_s(self, trainers: int) -> float:
        """The least time its micro-steps take on ``trainers`` cells (F1, F2)."""
        return max(self.train_s / trainers, self.largest_micro_s)


@dataclass(frozen=True)
class RunWork:
    """What a run of ``steps`` steps consumed, and the versions it is known to have
    published in [1, steps - 1] (a subset of those it did publish)."""

    steps: int
    groups: tuple[GroupWork, ...]
    published: frozenset[int]


@dataclass(frozen=True)
class RunBound:
    """The three lower bounds on a run's end-to-end time, in seconds."""

    resource_s: float
    littles_law_s: float
    critical_chain_s: float

    def terms(self) -> dict[str, float]:
        return {
            "resource": self.resource_s,
            "littles_law": self.littles_law_s,
            "critical_chain": self.critical_chain_s,
        }

    @property
    def seconds(self) -> float:
        """The bound: the largest term."""
        return max(self.terms().values())

    @property
    def binding(self) -> str:
        """The name of the largest term."""
        terms = self.terms()
        return max(terms, key=terms.__getitem__)


@dataclass(frozen=True)
class PolicyCells:
    """What a policy's rules guarantee about its K cells (F4).

    ``trainers`` (K'): the most cells in training at once: K, async its split T_a.
    ``rollout``: the most cells in rollout at once: K, async K - T_a.
    ``idle``: cells out of rollout through every step's overhead window and every
    publication. Async: its T_a cells, which never move. Colocate: all K: the pool is
    one unit that joins at once (``_join``), a batch is assigned only with a cell in
    training, and the pool leaves training only at PublicationDone
    (``_core_stays_or_returns``; ``_end_burst`` returns satellites, it has none).
    Elastic: the core, by the same argument: units join core first and the core leaves
    only at PublicationDone.
    ``first_switch``: cells that spend ``rollout_to_training_s`` in transition before the
    first micro-step: none for async (it starts in training), the core for elastic, all
    K for colocate (all cells start in rollout; the pool moves as one).
    """

    trainers: int
    rollout: int
    idle: int
    first_switch: int


def policy_cells(params: SchedulerParams) -> PolicyCells:
    """The guarantees of :class:`PolicyCells` for ``params.policy``."""
    k = params.cells
    if params.policy == "async":
        split = params.async_training_cells
        return PolicyCells(trainers=split, rollout=k - split, idle=split, first_switch=0)
    if params.policy == "colocate":
        return PolicyCells(trainers=k, rollout=k, idle=k, first_switch=k)
    return PolicyCells(trainers=k, rollout=k, idle=1, first_switch=1)


def run_work(
    scheduler: Scheduler, specs: Mapping[int, ExecutionSpec], costs: SimCosts, steps: int
) -> RunWork:
    """The work of a finished run: its groups trained in steps 0..steps-1 (``specs``
    maps execution ids to what they did) and the versions in [1, steps - 1] that some
    dispatched group was admitted under (each was published, F3)."""
    groups = []
    for consumed in scheduler.consumed():
        if consumed.v_t >= steps:
            continue
        counted = [specs[eid] for eid in scheduler.groups[consumed.group_id].valid]
        durations = [spec.duration_s for spec in counted]
        tokens = float(sum(spec.train_tokens for spec in counted))
        groups.append(
            GroupWork(
                step=consumed.v_t,
                version=consumed.v_d,
                longest_s=max(durations, default=0.0),
                rollout_s=sum(durations),
                train_s=costs.micro_step_s(tokens),
                largest_micro_s=costs.micro_step_s(min(tokens, costs.micro_step_tokens)),
            )
        )
    published = frozenset(g.v_d for g in scheduler.groups.values() if 0 < g.v_d < steps)
    return RunWork(steps, tuple(groups), published)


def run_bound(params: SchedulerParams, costs: SimCosts, work: RunWork) -> RunBound:
    """All three terms for ``work``; T >= each of them."""
    return RunBound(
        resource_s=resource_s(params, costs, work),
        littles_law_s=littles_law_s(params, costs, work),
        critical_chain_s=critical_chain_s(params, costs, work),
    )


def publications(params: SchedulerParams, work: RunWork) -> int:
    """Publications that lie whole between the first and the last step (F3): the known
    ones, and at least ceil(S / mu) - 1 since no burst has more than mu steps."""
    return max(len(work.published), math.ceil(work.steps / params.mu) - 1)


def resource_s(params: SchedulerParams, costs: SimCosts, work: RunWork) -> float:
    """Cell-seconds: the consumed work over the cells that can do it.

    Let x(t), u(t) be the cells in rollout and out of it (u = K - x). By F1 the counted
    executions, R execution-seconds in all, ran inside [0, T] on at most
    x(t) C_e + C_s slots, so R <= integral of (x C_e + C_s). The micro-steps of the
    consumed groups, W cell-seconds, ran inside [0, T] on cells in training, one each
    at a time (F1, F2). Cells out of rollout that run no micro-step also include, in
    windows disjoint from each other and from all micro-steps, I cell-seconds:

    - ``idle`` cells (:class:`PolicyCells`) through each of the S overhead windows
      (F2; the last one ends at T) and each of the ``publications`` (F3);
    - ``first_switch`` cells in transition for ``rollout_to_training_s`` before the
      first micro-step.

    So W + I <= integral of u. Adding R / C_e to that:
    R / C_e + W + I <= (K + C_s / C_e) T, the pooled bound. Alone:
    R <= (``rollout`` C_e + C_s) T, and W + I <= ``trainers`` T since u <= ``trainers``
    (for async both are stronger than the pooled bound: its cells never change role).
    Overhead is charged only to the cells it must idle: the others may roll out
    meanwhile.
    """
    cells = policy_cells(params)
    rollout = sum(g.rollout_s for g in work.groups)
    waits = work.steps * costs.train_step_overhead_s + publications(params, work) * costs.publish_s
    idle = cells.idle * waits + cells.first_switch * costs.rollout_to_training_s
    busy = sum(g.train_s for g in work.groups) + idle
    c_e, c_s = params.cell_capacity, params.standalone_capacity
    pooled = (rollout + busy * c_e) / (params.cells * c_e + c_s)
    return max(pooled, rollout / (cells.rollout * c_e + c_s), busy / cells.trainers)


def littles_law_s(params: SchedulerParams, costs: SimCosts, work: RunWork) -> float:
    """Dispatch slots: at most Q = (phi + mu) B groups hold one at any time.

    Boundary dispatch: a group holds its slot from its dispatch until it is trained
    (``_slots_held``: rollout, ready or assigned). Groups are created only by
    ``_dispatch_group``: ``_refill`` tops the held slots up to Q, and ``_unstall``
    replaces only groups dropped since the last refill, which freed their slots; so at
    most Q are held at any time. A consumed group g holds its slot inside [0, T] for at
    least L_g (its counted executions launch after its dispatch and it is ready only once
    they finished, F1), then its micro-steps (F2: ``GroupWork.training_s``), then its
    step's overhead o (it is trained at StepDone). Integrating the held slots over
    [0, T]: Q T >= sum over consumed g of (L_g + training_g + o).

    Continuous dispatch (Q_c = Q): a group holds its slot only while in rollout
    (``_slots_held``); a new group is dispatched exactly when one leaves rollout
    (``_make_ready``, ``_drop``), and ``_refill`` only tops up to Q_c, so at most Q_c
    groups are in rollout at any time. Consumed group g is in rollout for at least L_g,
    all before R*, when the last of them becomes ready; that group still needs its
    micro-steps and o. So T >= sum of L_g / Q_c + min over g of training_g + o: the
    appendix's T_c = B L / Q_c per step.
    """
    trainers = policy_cells(params).trainers
    o = costs.train_step_overhead_s
    depth = params.queue_depth
    if params.dispatch == "boundary":
        return sum(g.longest_s + g.training_s(trainers) + o for g in work.groups) / depth
    tail = min((g.training_s(trainers) for g in work.groups), default=0.0)
    return sum(g.longest_s for g in work.groups) / depth + tail + o


def critical_chain_s(params: SchedulerParams, costs: SimCosts, work: RunWork) -> float:
    """The steps in sequence: the larger of two chains.

    Both use, for step s with groups G_s, that its micro-steps run between its start and
    its end minus o, on at most K' cells (F1, F2), so they span at least
    ``_step_training_s``; that its start is after StepDone(s - 1), and after
    publication p more when a burst ends between s - 1 and s (F3); and that step 0
    starts after ``first_switch`` cells moved (``rollout_to_training_s``, when any must)
    and after its first group is ready, no earlier than its shortest L_g (v_d = 0).

    Serial: T >= start of step 0 + sum over s of (training_s + o) + ``publications`` p.

    Through releases: a lower bound e_s on each step's end, in step order. Group g
    cannot be ready before r_g = a_g + L_g, where a_g = e_{v_d - 1} + p when v_d >= 1
    (its dispatch follows PublicationDone(v_d), F3) and 0 otherwise. Step s starts at
    or after b_s = e_{s-1} (+ p if v = s is a known publication); without streaming at
    or after max r_g too (``_assign_ready`` assigns the whole batch at once). The work of
    the groups released at or after r_g runs after max(r_g, b_s) on at most K' cells, and
    g's own micro-steps take ``GroupWork.training_s``; e_s is the latest of these
    completions plus o. T >= e_{S-1}.
    """
    return max(_serial_chain_s(params, costs, work), _release_chain_s(params, costs, work))


def _by_step(work: RunWork) -> list[list[GroupWork]]:
    steps: list[list[GroupWork]] = [[] for _ in range(work.steps)]
    for group in work.groups:
        steps[group.step].append(group)
    return steps


def _step_training_s(groups: list[GroupWork], trainers: int) -> float:
    """The least time one step's micro-steps take on ``trainers`` cells."""
    total = sum(g.train_s for g in groups) / trainers
    return max([total, *(g.largest_micro_s for g in groups)])


def _first_switch_s(params: SchedulerParams, costs: SimCosts) -> float:
    return costs.rollout_to_training_s if policy_cells(params).first_switch else 0.0


def _serial_chain_s(params: SchedulerParams, costs: SimCosts, work: RunWork) -> float:
    trainers = policy_cells(params).trainers
    by_step = _by_step(work)
    first_ready = min((g.longest_s for g in by_step[0]), default=0.0)
    training = sum(_step_training_s(groups, trainers) for groups in by_step)
    return (
        max(_first_switch_s(params, costs), first_ready)
        + training
        + work.steps * costs.train_step_overhead_s
        + publications(params, work) * costs.publish_s
    )


def _release_chain_s(params: SchedulerParams, costs: SimCosts, work: RunWork) -> float:
    trainers = policy_cells(params).trainers
    p = costs.publish_s
    ends: list[float] = []
    for s, groups in enumerate(_by_step(work)):
        if s == 0:
            start = _first_switch_s(params, costs)
        else:
            start = ends[-1] + (p if s in work.published else 0.0)
        released = sorted(
            ((ends[g.version - 1] + p if g.version else 0.0) + g.longest_s, i)
            for i, g in enumerate(groups)
        )
        if released and not params.streaming:
            start = max(start, released[-1][0])
        done = start + _step_training_s(groups, trainers)
        later = 0.0
        for ready, i in reversed(released):
            group = groups[i]
            later += group.train_s
            begin = max(ready, start)
            done = max(done, begin + later / trainers, begin + group.training_s(trainers))
        ends.append(done + costs.train_step_overhead_s)
    return ends[-1]
