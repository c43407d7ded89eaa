"""Streaming training buffers: ready groups, packing into micro-steps, the claim queue.

docs/design.md §3 (training) and the paper "streaming training". Three pieces, in data order:

``TrajectoryBuffer``
    Ready rollout groups (rewards known, trajectories admitted) keyed by group id.
    ``ready_ids()`` lists them oldest policy version first (``GroupSample.version``,
    the version at dispatch), then by group id. ``take`` removes a group; a group
    can be taken exactly once, ever: its id stays in ``taken`` and adding or taking
    it again raises. ``state_dict`` holds the pending groups' full samples and the
    taken ids, so a resumed run neither trains a group twice nor loses one. A group
    may wait as a ``StoredGroup`` (a resumed run's, on disk in the ledger): its
    tokens are read when it is taken.

``PackingBuffer``
    Synchronous and pure (no asyncio, no I/O): the runtime owns concurrency.
    ``assign(step, group_ids, closes_batch)`` takes the groups the scheduler
    assigned to the step from the trajectory buffer and turns each execution into
    one *packing unit*: all of an execution's admitted trajectories, which are
    never split across micro-steps (the objective's execution ratio ``s_i`` needs
    all of execution ``i``'s target tokens in one forward). A micro-step is one
    packed row, the concatenation of whole trajectories, with no padding.

    Packing rule, with budget ``T = tokens_per_micro_step``:

    - a unit longer than ``T`` is emitted at once as a micro-step of its own (over
      budget; counted in ``BatchSummary.num_over_budget``);
    - otherwise the pending units fill a micro-step greedily, largest first, each
      unit going in if it still fits (first-fit decreasing for one bin); the
      micro-step is emitted if it reaches ``fill_fraction * T`` (0.95 by default),
      or if it reaches ``LEFTOVER_FILL * T`` (0.75) while pending units are left
      out because none of them fits (executions large against ``T`` would
      otherwise wait for the whole batch, starving the training cells); this
      repeats until neither holds; the rest stays pending for later groups;
    - with ``closes_batch`` every pending unit is flushed by the same greedy fill,
      whatever the fill, and the step closes (``summary(step)`` becomes available).

    Executions that contribute no gradient -- advantage exactly 0 (all rewards of
    the group equal) or no target token -- are skipped: their rows are not packed,
    but they count in ``BatchSummary.num_executions`` (the objective's ``N``) and in
    ``num_zero_gradient``.

    Target tokens: the token at position ``p`` is predicted from position ``p - 1``,
    so a trajectory's first token can never be a target (rows start with injected
    prompt tokens); a first token marked as a target is dropped from the targets.

``MicroStepQueue``
    asyncio. One step at a time: ``open(step)``, ``put`` its micro-steps, ``close``
    with the step's ``BatchSummary`` once all are enqueued. ``claim(cell)`` hands out
    each micro-step exactly once (disjoint work, recorded in ``claims``), waits while
    the queue is empty and the step open, and returns None once it is closed and
    drained.
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from qwengyre.trajectories import routed_experts
from qwengyre.trajectories.selection import AdmittedTrajectory

__all__ = [
    "BatchSummary",
    "ExecutionSample",
    "GroupSample",
    "MicroStep",
    "MicroStepQueue",
    "PackingBuffer",
    "StoredGroup",
    "TrajectoryBuffer",
    "split_micro_step",
]

DEFAULT_FILL_FRACTION = 0.95
LEFTOVER_FILL = 0.75


def _trajectory_to_json(t: AdmittedTrajectory) -> dict[str, Any]:
    routing = None
    if t.routing is not None:
        data, form = routed_experts.encode(t.routing)
        routing = {"form": form, "base64": base64.b64encode(data).decode()}
    return {
        "leaf": t.leaf,
        "request_class": t.request_class,
        "nodes": list(t.nodes),
        "input_ids": list(t.input_ids),
        "target_mask": list(t.target_mask),
        "behaviour_logprobs": list(t.behaviour_logprobs),
        "versions": list(t.versions),
        "execution_id": t.execution_id,
        "advantage": t.advantage,
        "routing": routing,
    }


def _trajectory_from_json(d: dict[str, Any]) -> AdmittedTrajectory:
    routing = d.get("routing")  # absent: written before routed experts were kept
    return AdmittedTrajectory(
        leaf=int(d["leaf"]),
        request_class=str(d["request_class"]),
        nodes=tuple(int(x) for x in d["nodes"]),
        input_ids=tuple(int(x) for x in d["input_ids"]),
        target_mask=tuple(bool(x) for x in d["target_mask"]),
        behaviour_logprobs=tuple(float(x) for x in d["behaviour_logprobs"]),
        versions=tuple(int(x) for x in d["versions"]),
        execution_id=str(d["execution_id"]),
        advantage=float(d["advantage"]),
        routing=None
        if routing is None
        else routed_experts.decode(base64.b64decode(routing["base64"]), routing["form"]),
    )


def _targets(t: AdmittedTrajectory) -> list[bool]:
    """The trajectory's target mask with its first token never a target."""
    mask = list(t.target_mask)
    if mask:
        mask[0] = False
    return mask


@dataclass(frozen=True)
class ExecutionSample:
    """One execution's admitted trajectories and its group-relative advantage."""

    execution_id: str
    advantage: float
    trajectories: tuple[AdmittedTrajectory, ...]

    def __post_init__(self) -> None:
        for t in self.trajectories:
            if t.execution_id not in ("", self.execution_id):
                raise ValueError(
                    f"trajectory of execution {t.execution_id!r} in sample {self.execution_id!r}"
                )

    @property
    def num_tokens(self) -> int:
        return sum(len(t.input_ids) for t in self.trajectories)

    @property
    def num_targets(self) -> int:
        """Target tokens once packed (a trajectory's first token is never one)."""
        return sum(sum(_targets(t)) for t in self.trajectories)

    @property
    def has_gradient(self) -> bool:
        return self.advantage != 0.0 and self.num_targets > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "advantage": self.advantage,
            "trajectories": [_trajectory_to_json(t) for t in self.trajectories],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExecutionSample:
        return cls(
            execution_id=str(d["execution_id"]),
            advantage=float(d["advantage"]),
            trajectories=tuple(_trajectory_from_json(t) for t in d["trajectories"]),
        )


@dataclass(frozen=True)
class GroupSample:
    """A ready rollout group: its executions and the policy version at dispatch (v_d)."""

    group_id: int
    version: int
    executions: tuple[ExecutionSample, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "version": self.version,
            "executions": [e.to_json() for e in self.executions],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GroupSample:
        return cls(
            group_id=int(d["group_id"]),
            version=int(d["version"]),
            executions=tuple(ExecutionSample.from_json(e) for e in d["executions"]),
        )


@dataclass(frozen=True)
class StoredGroup:
    """A ready group kept on disk: its id and version at dispatch at hand, its
    executions read by ``load()`` (which returns the group of that id and version)."""

    group_id: int
    version: int
    load: Callable[[], GroupSample]


class TrajectoryBuffer:
    """Ready groups by id; each is taken exactly once, oldest version first."""

    def __init__(self) -> None:
        self._ready: dict[int, GroupSample | StoredGroup] = {}
        self.taken: set[int] = set()

    def __len__(self) -> int:
        return len(self._ready)

    def add(self, group: GroupSample | StoredGroup) -> None:
        gid = group.group_id
        if gid in self._ready:
            raise ValueError(f"group {gid} is already in the trajectory buffer")
        if gid in self.taken:
            raise ValueError(f"group {gid} was already taken for training")
        self._ready[gid] = group

    def ready_ids(self) -> list[int]:
        """Ready group ids, oldest policy version first, then by group id."""
        return sorted(self._ready, key=lambda gid: (self._ready[gid].version, gid))

    def check_ready(self, group_id: int) -> None:
        """Raise unless ``group_id`` can be taken (ValueError: taken; KeyError: unknown)."""
        if group_id in self.taken:
            raise ValueError(f"group {group_id} was already taken for training")
        if group_id not in self._ready:
            raise KeyError(f"group {group_id} is not ready in the trajectory buffer")

    def take(self, group_id: int) -> GroupSample:
        self.check_ready(group_id)
        group = _loaded(self._ready[group_id])
        self.taken.add(group_id)
        del self._ready[group_id]
        return group

    def state_dict(self) -> dict[str, Any]:
        return {
            "ready": [_loaded(self._ready[gid]).to_json() for gid in self.ready_ids()],
            "taken": sorted(self.taken),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ready = {}
        self.taken = {int(gid) for gid in state["taken"]}
        for group in state["ready"]:
            self.add(GroupSample.from_json(group))


def _loaded(group: GroupSample | StoredGroup) -> GroupSample:
    if isinstance(group, GroupSample):
        return group
    sample = group.load()
    if (sample.group_id, sample.version) != (group.group_id, group.version):
        raise ValueError(
            f"stored group {group.group_id} (version {group.version}) loaded as group "
            f"{sample.group_id} (version {sample.version})"
        )
    return sample


@dataclass(kw_only=True, frozen=True)
class MicroStep:
    """One packed row (batch dim 1, no padding) of whole trajectories.

    Token tensors are [1, L]. ``position_ids`` restart at 0 at each trajectory, so
    with ``attention_mask=None`` and ``use_cache=False`` transformers attends within
    each trajectory only. ``target_mask`` marks the tokens to score (predicted from
    the previous position); ``behaviour_logprobs`` is 0 where a token was not
    sampled; ``execution_index`` indexes ``advantages`` / ``execution_ids`` for every
    token of a trajectory; ``trajectory_index`` is a running id within the row.
    ``routing`` (an MoE's recorded routing, where any trajectory has it): ``[1, L,
    layers, k]`` int16, the experts each *position* was routed to when it was sampled
    (-1: not recorded), for :class:`~qwengyre.models.experts.RoutingReplay`.
    """

    step: int
    index: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    execution_index: torch.Tensor
    trajectory_index: torch.Tensor
    advantages: torch.Tensor
    execution_ids: tuple[str, ...]
    group_ids: tuple[int, ...]
    routing: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_targets(self) -> int:
        return int(self.target_mask.sum())


def split_micro_step(ms: MicroStep, parts: int) -> list[MicroStep | None]:
    """``ms`` cut into ``parts`` rows of whole executions, balanced by tokens (longest
    first, each to the lightest part), for the ranks of a sharded cell; ``None`` for a
    part that got no execution. The parts' summed objectives add up to ``ms``'s (an
    execution's ratio needs all its tokens, so an execution is never cut)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1:
        return [ms]
    index = ms.execution_index[0]
    spans = [
        (int(e), int(torch.nonzero(index == e)[0]), int((index == e).sum()))
        for e in range(int(ms.advantages.numel()))
    ]
    chosen: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    load = [0] * parts
    for span in sorted(spans, key=lambda s: (-s[2], s[0])):
        lightest = load.index(min(load))
        chosen[lightest].append(span)
        load[lightest] += span[2]
    out: list[MicroStep | None] = []
    for part in chosen:
        if not part:
            out.append(None)
            continue
        part.sort()
        cols = torch.cat([torch.arange(start, start + n) for _, start, n in part])
        executions = [e for e, _, _ in part]
        renumber = torch.zeros(int(ms.advantages.numel()), dtype=torch.long)
        renumber[executions] = torch.arange(len(executions))
        out.append(
            replace(
                ms,
                input_ids=ms.input_ids[:, cols],
                position_ids=ms.position_ids[:, cols],
                target_mask=ms.target_mask[:, cols],
                behaviour_logprobs=ms.behaviour_logprobs[:, cols],
                execution_index=renumber[ms.execution_index[:, cols]],
                trajectory_index=ms.trajectory_index[:, cols],
                advantages=ms.advantages[executions],
                execution_ids=tuple(ms.execution_ids[e] for e in executions),
                routing=None if ms.routing is None else ms.routing[:, cols],
            )
        )
    return out


@dataclass(kw_only=True, frozen=True)
class BatchSummary:
    """What the trainer needs to normalise one step's summed gradient.

    ``num_executions`` counts every execution of the batch's groups (zero-gradient
    ones included): the default objective divides by it; ``token_sum`` divides by
    ``num_target_tokens`` (of the packed rows).
    """

    step: int
    group_ids: tuple[int, ...]
    num_executions: int
    num_target_tokens: int
    num_micro_steps: int
    num_tokens: int
    num_over_budget: int = 0
    num_zero_gradient: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "group_ids": list(self.group_ids),
            "num_executions": self.num_executions,
            "num_target_tokens": self.num_target_tokens,
            "num_micro_steps": self.num_micro_steps,
            "num_tokens": self.num_tokens,
            "num_over_budget": self.num_over_budget,
            "num_zero_gradient": self.num_zero_gradient,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BatchSummary:
        return cls(
            step=int(d["step"]),
            group_ids=tuple(int(g) for g in d["group_ids"]),
            num_executions=int(d["num_executions"]),
            num_target_tokens=int(d["num_target_tokens"]),
            num_micro_steps=int(d["num_micro_steps"]),
            num_tokens=int(d["num_tokens"]),
            num_over_budget=int(d["num_over_budget"]),
            num_zero_gradient=int(d["num_zero_gradient"]),
        )


@dataclass(frozen=True)
class _Unit:
    """A packing unit: one execution with gradient, and its group."""

    group_id: int
    execution: ExecutionSample

    @property
    def size(self) -> int:
        return self.execution.num_tokens


def _pack(step: int, index: int, units: Sequence[_Unit]) -> MicroStep:
    ids: list[int] = []
    positions: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    exec_index: list[int] = []
    traj_index: list[int] = []
    routing: list[np.ndarray | None] = []
    lengths: list[int] = []
    traj = 0
    for e, unit in enumerate(units):
        for t in unit.execution.trajectories:
            n = len(t.input_ids)
            routing.append(t.routing)
            lengths.append(n)
            ids += t.input_ids
            positions += range(n)
            mask += _targets(t)
            logprobs += t.behaviour_logprobs
            exec_index += [e] * n
            traj_index += [traj] * n
            traj += 1

    def row(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).reshape(1, -1)

    before = routed_experts.join(routing, lengths)
    if before is not None:
        routed = torch.from_numpy(routed_experts.by_position(before).astype(np.int16))

    return MicroStep(
        step=step,
        index=index,
        input_ids=row(ids, torch.long),
        position_ids=row(positions, torch.long),
        target_mask=row(mask, torch.bool),
        behaviour_logprobs=row(logprobs, torch.float32),
        execution_index=row(exec_index, torch.long),
        trajectory_index=row(traj_index, torch.long),
        advantages=torch.tensor([u.execution.advantage for u in units], dtype=torch.float32),
        execution_ids=tuple(u.execution.execution_id for u in units),
        group_ids=tuple(dict.fromkeys(u.group_id for u in units)),
        routing=None if before is None else routed.unsqueeze(0),
    )


class PackingBuffer:
    """Packs assigned groups' executions into micro-steps; see the module docstring."""

    def __init__(
        self,
        trajectory_buffer: TrajectoryBuffer,
        tokens_per_micro_step: int,
        *,
        fill_fraction: float = DEFAULT_FILL_FRACTION,
    ) -> None:
        if tokens_per_micro_step <= 0:
            raise ValueError(f"tokens_per_micro_step must be > 0, got {tokens_per_micro_step}")
        if not 0.0 < fill_fraction <= 1.0:
            raise ValueError(f"fill_fraction must be in (0, 1], got {fill_fraction}")
        self.trajectory_buffer = trajectory_buffer
        self.tokens_per_micro_step = tokens_per_micro_step
        self.fill_fraction = fill_fraction
        self._summaries: dict[int, BatchSummary] = {}
        self._reset_step(None)

    def _reset_step(self, step: int | None) -> None:
        self._step = step
        self._pending: list[_Unit] = []
        self._group_ids: list[int] = []
        self._num_executions = 0
        self._num_targets = 0
        self._num_micro_steps = 0
        self._num_tokens = 0
        self._num_over_budget = 0
        self._num_zero_gradient = 0

    def summary(self, step: int) -> BatchSummary:
        if step not in self._summaries:
            raise KeyError(f"step {step} is not closed")
        return self._summaries[step]

    def assign(self, step: int, group_ids: Sequence[int], closes_batch: bool) -> list[MicroStep]:
        """Take ``group_ids`` for ``step`` and return the micro-steps this can emit."""
        if step in self._summaries or (self._summaries and step < max(self._summaries)):
            raise ValueError(f"step {step} is already closed")
        if self._step is not None and step != self._step:
            raise ValueError(f"step {self._step} is open; cannot assign to step {step}")
        if len(set(group_ids)) != len(group_ids):
            raise ValueError(f"step {step}: group ids assigned twice in {list(group_ids)}")
        for gid in group_ids:
            self.trajectory_buffer.check_ready(gid)
        if self._step is None:
            self._reset_step(step)
        emitted: list[MicroStep] = []
        for gid in group_ids:
            group = self.trajectory_buffer.take(gid)
            self._group_ids.append(gid)
            for execution in group.executions:
                self._num_executions += 1
                if not execution.has_gradient:
                    self._num_zero_gradient += 1
                    continue
                unit = _Unit(gid, execution)
                if unit.size > self.tokens_per_micro_step:
                    self._num_over_budget += 1
                    emitted.append(self._emit([unit]))
                else:
                    self._pending.append(unit)
        while self._pending:
            units = self._fill()
            fill = sum(u.size for u in units) / self.tokens_per_micro_step
            full = fill >= self.fill_fraction or (
                fill >= LEFTOVER_FILL and len(units) < len(self._pending)
            )
            if not (full or closes_batch):
                break
            emitted.append(self._emit(units))
        if closes_batch:
            self._summaries[step] = BatchSummary(
                step=step,
                group_ids=tuple(self._group_ids),
                num_executions=self._num_executions,
                num_target_tokens=self._num_targets,
                num_micro_steps=self._num_micro_steps,
                num_tokens=self._num_tokens,
                num_over_budget=self._num_over_budget,
                num_zero_gradient=self._num_zero_gradient,
            )
            self._reset_step(None)
        return emitted

    def _fill(self) -> list[_Unit]:
        """First-fit decreasing for one micro-step over the pending units."""
        room = self.tokens_per_micro_step
        chosen: list[_Unit] = []
        for unit in sorted(self._pending, key=lambda u: -u.size):
            if unit.size <= room:
                chosen.append(unit)
                room -= unit.size
        return chosen

    def _emit(self, units: list[_Unit]) -> MicroStep:
        assert self._step is not None
        taken = {id(u) for u in units}
        self._pending = [u for u in self._pending if id(u) not in taken]
        micro_step = _pack(self._step, self._num_micro_steps, units)
        self._num_micro_steps += 1
        self._num_tokens += micro_step.num_tokens
        self._num_targets += micro_step.num_targets
        return micro_step

    def state_dict(self) -> dict[str, Any]:
        """The open step's pending executions and counts, and the closed summaries.

        Micro-steps already emitted belong to the queue and the trainer, not here:
        checkpoint at step boundaries, where nothing is pending or in flight.
        """
        return {
            "step": self._step,
            "pending": [
                {"group_id": u.group_id, "execution": u.execution.to_json()} for u in self._pending
            ],
            "group_ids": list(self._group_ids),
            "num_executions": self._num_executions,
            "num_target_tokens": self._num_targets,
            "num_micro_steps": self._num_micro_steps,
            "num_tokens": self._num_tokens,
            "num_over_budget": self._num_over_budget,
            "num_zero_gradient": self._num_zero_gradient,
            "summaries": [s.to_json() for s in self._summaries.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state["step"]
        self._reset_step(None if step is None else int(step))
        self._pending = [
            _Unit(int(p["group_id"]), ExecutionSample.from_json(p["execution"]))
            for p in state["pending"]
        ]
        self._group_ids = [int(g) for g in state["group_ids"]]
        self._num_executions = int(state["num_executions"])
        self._num_targets = int(state["num_target_tokens"])
        self._num_micro_steps = int(state["num_micro_steps"])
        self._num_tokens = int(state["num_tokens"])
        self._num_over_budget = int(state["num_over_budget"])
        self._num_zero_gradient = int(state["num_zero_gradient"])
        self._summaries = {
            s.step: s for s in (BatchSummary.from_json(d) for d in state["summaries"])
        }


class MicroStepQueue:
    """The shared queue cells claim micro-steps from, one step at a time."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.step: int | None = None
        self._items: deque[MicroStep] = deque()
        self._num_put = 0
        self.claims: dict[int, int] = {}
        self._claimed: dict[int, list[MicroStep]] = {}  # cell -> its claims, in order
        self.summary: BatchSummary | None = None

    def open(self, step: int) -> None:
        """Start ``step``; the previous step must be closed and drained."""
        if self.step is not None and not self.drained:
            raise ValueError(f"step {self.step} is not closed and drained")
        if self.step is not None and step <= self.step:
            raise ValueError(f"step {step} does not follow step {self.step}")
        self.step = step
        self._items.clear()
        self._num_put = 0
        self.claims = {}
        self._claimed = {}
        self.summary = None

    @property
    def drained(self) -> bool:
        """Closed, and every micro-step claimed."""
        return self.summary is not None and not self._items

    @property
    def queued(self) -> int:
        """Micro-steps put and not yet claimed."""
        return len(self._items)

    async def put(self, micro_step: MicroStep) -> None:
        if self.step is None or micro_step.step != self.step:
            raise ValueError(f"micro-step of step {micro_step.step}; open step is {self.step}")
        if self.summary is not None:
            raise ValueError(f"step {self.step} is closed")
        async with self._cond:
            self._items.append(micro_step)
            self._num_put += 1
            self._cond.notify(1)

    async def close(self, summary: BatchSummary) -> None:
        """Close the open step once all its micro-steps are enqueued."""
        if summary.step != self.step:
            raise ValueError(f"summary of step {summary.step}; open step is {self.step}")
        if self.summary is not None:
            raise ValueError(f"step {self.step} is already closed")
        if summary.num_micro_steps != self._num_put:
            raise ValueError(
                f"step {self.step}: summary counts {summary.num_micro_steps} micro-steps, "
                f"{self._num_put} were put"
            )
        async with self._cond:
            self.summary = summary
            self._cond.notify_all()

    async def claim(self, cell: int) -> MicroStep | None:
        """The next micro-step for ``cell``; None once the step is closed and drained."""
        async with self._cond:
            while not self._items and self.summary is None:
                await self._cond.wait()
            if not self._items:
                return None
            micro_step = self._items.popleft()
            self.claims[micro_step.index] = cell
            self._claimed.setdefault(cell, []).append(micro_step)
            if self.drained:
                self._cond.notify_all()
            return micro_step

    async def give_back(self, cell: int) -> int:
        """``cell`` left the open step before its update: every micro-step it claimed
        goes back to the front of the queue, in order, for the cells that stay; how
        many. (The update sums whole micro-steps, so one trained again elsewhere gives
        the same result as if ``cell`` had never claimed it.)"""
        returned = self._claimed.pop(cell, [])
        async with self._cond:
            self._items.extendleft(reversed(returned))
            for micro_step in returned:
                del self.claims[micro_step.index]
            self._cond.notify_all()
        return len(returned)

    async def wait_drained(self) -> BatchSummary:
        """Wait until the open step is closed and every micro-step claimed."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.drained)
        assert self.summary is not None
        return self.summary
