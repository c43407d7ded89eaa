"""What a live run records about itself as it goes (qwengyre.records.metrics): the cells'
roles and switches, publications, the scheduler's load, each cell's busy time, and every
training step with the groups it trained.

:class:`Observer` watches the controller's run and writes the metrics log; it never
decides anything. The controller tells it what happened (a switch, a publication, a
step's results) and asks it to time the training calls; after every event it reads the
scheduler's state itself.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from qwengyre.records.metrics import (
    GroupRecord,
    LoadRecord,
    MetricsWriter,
    PublicationRecord,
    RoleRecord,
    StepRecord,
    SwitchRecord,
    UsageRecord,
)
from qwengyre.scheduler.core import Scheduler
from qwengyre.scheduler.events import Role
from qwengyre.training.backend import MicroStepResult, StepResult
from qwengyre.training.buffers import BatchSummary

__all__ = ["Observer"]

T = TypeVar("T")


class Observer:
    """The run's metrics records, stamped with the controller's clock ``now``."""

    def __init__(
        self, metrics: MetricsWriter, scheduler: Scheduler, now: Callable[[], float]
    ) -> None:
        self.metrics = metrics
        self.scheduler = scheduler
        self.now = now
        self.step_records: list[StepRecord] = []
        self._roles = list(scheduler.roles)
        self._last_load = (-1, -1, -1, -1, -1)
        self._busy_s = [0.0] * len(self._roles)  # per cell, see UsageRecord
        self._serving = [False] * len(self._roles)  # rollout with executions routed to it
        self._accounted_at = 0.0

    def start(self) -> None:
        """Every cell's role at the start."""
        for cell, role in enumerate(self._roles):
            self.metrics.write(RoleRecord(0.0, cell, role.value))

    def account(self) -> None:
        """Rollout busy time up to now (training time is added per call)."""
        now = self.now()
        for cell, serving in enumerate(self._serving):
            if serving:
                self._busy_s[cell] += now - self._accounted_at
        self._accounted_at = now

    def observe(self) -> None:
        """After an event: which cells serve, a role record for every role that
        changed, a load record if the scheduler's counters changed."""
        s = self.scheduler
        self._serving = [
            role is Role.ROLLOUT and bool(s.running_on(cell)) for cell, role in enumerate(s.roles)
        ]
        now = self.now()
        for cell, role in enumerate(s.roles):
            if role is not self._roles[cell]:
                self._roles[cell] = role
                self.metrics.write(RoleRecord(now, cell, role.value))
        c = s.counters
        sample = (c.running, c.queued, s.capacity, c.reserved, s.stalls)
        if sample != self._last_load:
            self._last_load = sample
            running, queued, capacity, reserved, stalls = sample
            self.metrics.write(
                LoadRecord(
                    time_s=self.now(),
                    running=running,
                    queued=queued,
                    capacity=capacity,
                    reserved=reserved,
                    stalls=stalls,
                )
            )

    async def timed(self, cell: int, call: Awaitable[T]) -> tuple[T, float]:
        """A training call on ``cell`` and its duration, counted as busy."""
        start = time.monotonic()
        try:
            return await call, time.monotonic() - start
        finally:
            self._busy_s[cell] += time.monotonic() - start

    def switch(self, cell: int, to: str, seconds: float, how: str) -> None:
        self.metrics.write(
            SwitchRecord(time_s=self.now(), cell=cell, to=to, seconds=seconds, engine=how)
        )

    def publication(self, version: int, seconds: float) -> None:
        self.metrics.write(PublicationRecord(self.now(), version, seconds))

    def step(
        self,
        step: int,
        started_s: float,
        summary: BatchSummary,
        micro_steps: Sequence[MicroStepResult],
        micro_step_s: float,
        updates: Sequence[tuple[StepResult, float]],
        launched: Mapping[int, Sequence[int]],
    ) -> StepRecord:
        """A step's record (and one per group it trained, and the cells' usage):
        ``micro_steps`` its results, ``micro_step_s`` their time summed over cells,
        ``updates`` each participant's update and its duration (the core's first),
        ``launched`` the versions each trained group's valid executions launched at."""
        groups = self.scheduler.groups
        rewards = [r for g in summary.group_ids for r in groups[g].valid.values()]
        executions = sum(r.executions for r in micro_steps)
        targets = sum(r.targets for r in micro_steps)
        routed = sum(r.routed for r in micro_steps)
        core = updates[0][0]
        record = StepRecord(
            time_s=self.now(),
            step=step,
            version=core.version,
            reward_mean=statistics.fmean(rewards) if rewards else 0.0,
            reward_std=statistics.pstdev(rewards) if rewards else 0.0,
            rewards=len(rewards),
            loss=sum(r.loss for r in micro_steps) / max(summary.num_executions, 1),
            clipped_fraction=sum(r.clipped for r in micro_steps)
            / max(sum(r.executions for r in micro_steps), 1),
            grad_norm=core.grad_norm,
            tokens=summary.num_tokens,
            micro_steps=summary.num_micro_steps,
            cells=len(updates),
            train_s=self.now() - started_s,
            staleness_mean=statistics.fmean(step - groups[g].v_d for g in summary.group_ids),
            ratio_mean=sum(r.ratio_sum for r in micro_steps) / executions
            if executions
            else math.nan,
            kl=sum(r.kl_sum for r in micro_steps) / targets if targets else math.nan,
            routing_drift=sum(r.drifted for r in micro_steps) / routed if routed else math.nan,
            micro_step_s=micro_step_s,
            update_s=max(seconds for _, seconds in updates),
        )
        for gid in summary.group_ids:
            group = groups[gid]
            versions = launched[gid]
            self.metrics.write(
                GroupRecord(
                    time_s=self.now(),
                    group_id=gid,
                    dispatch_version=group.v_d,
                    step=step,
                    staleness=step - group.v_d,
                    execution_staleness=statistics.fmean(step - v for v in versions)
                    if versions
                    else math.nan,
                )
            )
        self.metrics.write(record)
        self.write_usage()
        self.step_records.append(record)
        return record

    def write_usage(self) -> None:
        """Each cell's busy and idle time so far."""
        self.account()
        now = self.now()
        for cell, busy in enumerate(self._busy_s):
            self.metrics.write(UsageRecord(now, cell, busy, max(0.0, now - busy)))
