"""What goes into the scheduler (events) and what comes out (actions).

Every event carries the time at which it happened, in seconds on whatever clock the
driver uses (virtual in the simulator, monotonic in the live runtime); the
scheduler only compares these times and never reads a clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from qwengyre.types import Outcome

STANDALONE = -1
"""Engine id of the standalone rollout pool; elastic cells are 0..K-1 (0 is the core)."""


class Role(StrEnum):
    """A cell's role. Cells in transition serve neither rollout nor training."""

    ROLLOUT = "rollout"
    TO_TRAINING = "to_training"
    TRAINING = "training"
    TO_ROLLOUT = "to_rollout"
    LOST = "lost"
    """Gone for good (:class:`CellLost`): it serves and trains no more."""


# ---------------------------------------------------------------- events (in)


@dataclass(frozen=True)
class Start:
    """The run begins: fill the dispatch queue and launch."""

    time: float


@dataclass(frozen=True)
class ExecutionFinished:
    """A launched execution terminated (exactly once), with its valid reward or None."""

    time: float
    execution_id: int
    outcome: Outcome
    reward: float | None


@dataclass(frozen=True)
class CellMoved:
    """A cell finished the transition that a :class:`MoveCell` action started."""

    time: float
    cell: int


@dataclass(frozen=True)
class CellLost:
    """Cell ``cell`` (not the core) is gone for good (its process died), in any role.

    The run goes on without it: its executions move to engines that serve (their
    harnesses keep running; the proxy already sent their calls elsewhere), or wait
    parked until one does; a switch it was making never ends; no cell at or past it
    trains again (cells join training as a prefix, core first, and the prefix now ends
    before it), so those in training return to rollout, and the driver gives the
    micro-steps they claimed in the open step to the cells that stay. If no engine is
    left to serve, the newest unit in training returns to rollout. The core cannot be
    lost: the driver stops the run (its optimizer dies with it).
    """

    time: float
    cell: int


@dataclass(frozen=True)
class StepDone:
    """The optimizer update of training step ``step`` is done (policy version step+1)."""

    time: float
    step: int


@dataclass(frozen=True)
class PublicationDone:
    """The weights of ``version`` reached every rollout engine."""

    time: float
    version: int


@dataclass(frozen=True)
class PullGroups:
    """The packing buffer wants ``count`` more ready groups for ``step``: fewer
    micro-steps wait than cells train (:meth:`Scheduler.wants_groups`).

    The demand replaces any earlier one and is met, oldest version first, from ready
    groups now or as they become ready (streaming). Ready groups that nobody has
    pulled yet are the supply that lets more cells join training (Eq 5).
    """

    time: float
    step: int
    count: int


@dataclass(frozen=True)
class Tick:
    """Time passed; sent at the times the scheduler asked for with :class:`WakeAt`."""

    time: float


Event = (
    Start
    | ExecutionFinished
    | CellMoved
    | CellLost
    | StepDone
    | PublicationDone
    | PullGroups
    | Tick
)


# ---------------------------------------------------------------- actions (out)


@dataclass(frozen=True)
class Dispatch:
    """New executions of rollout group ``group_id`` enter the queue.

    ``version`` is the published policy version at this dispatch: the group's v_d on
    its first dispatch (``topup=False``); later ones (``topup=True``) replace executions
    without valid rewards and may come after a publication (boundary dispatch owes them
    to the next boundary), when ``version`` is newer than v_d.
    """

    group_id: int
    execution_ids: tuple[int, ...]
    version: int
    topup: bool = False


@dataclass(frozen=True)
class Launch:
    """Start execution ``execution_id`` (index ``index`` in its group) on ``engine``.

    ``version`` is the policy version published when it launches: the weights it
    samples from (until a later publication updates its engine in place). A top-up's
    is newer than its group's v_d; the group's staleness stays v_t - v_d (Eq 2).
    """

    execution_id: int
    group_id: int
    index: int
    engine: int
    version: int


@dataclass(frozen=True)
class Adopt:
    """Execution ``execution_id`` of a resumed run still runs (its harness outlived the
    driver that launched it): it is in flight on ``engine`` from now on. Nothing is
    started; ``version`` is the one it launched with."""

    execution_id: int
    group_id: int
    index: int
    engine: int
    version: int


@dataclass(frozen=True)
class Cancel:
    """Stop a running execution; the driver still reports its ExecutionFinished."""

    execution_id: int


@dataclass(frozen=True)
class Reroute:
    """Route the running execution's future model calls from ``source`` to ``destination``."""

    execution_id: int
    source: int
    destination: int


@dataclass(frozen=True)
class MoveCell:
    """Start moving ``cell`` to ``role`` (TRAINING or ROLLOUT); answer with CellMoved."""

    cell: int
    role: Role


@dataclass(frozen=True)
class AssignGroups:
    """Ready groups join the batch of training step ``step``, oldest version first.

    Streaming: in answer to :class:`PullGroups`. Not streaming: all B at once, when
    they are ready and a cell trains. ``closes_batch`` is true on the assignment that
    completes the batch's B groups.
    """

    step: int
    group_ids: tuple[int, ...]
    closes_batch: bool


@dataclass(frozen=True)
class DropGroup:
    """The group cannot reach N valid rewards; it is never trained. Its slot refills at
    once (continuous dispatch) or at the next boundary (boundary dispatch)."""

    group_id: int


@dataclass(frozen=True)
class Publish:
    """Publish policy ``version`` to all rollout engines; answer with PublicationDone."""

    version: int


@dataclass(frozen=True)
class WakeAt:
    """Send a Tick at ``time``: a timed condition (the supply check's tau) may then hold."""

    time: float


Action = (
    Dispatch
    | Launch
    | Adopt
    | Cancel
    | Reroute
    | MoveCell
    | AssignGroups
    | DropGroup
    | Publish
    | WakeAt
)
