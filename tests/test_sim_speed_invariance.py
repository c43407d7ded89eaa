"""The simulator's speed work changed no decision: runs without random draws are pinned.

The expected values were computed with the simulator and scheduler as they were before
the per-event O(K) work was made incremental, at K = 2, 8 and 80
cells for every policy. Any change of behaviour, however small, moves one of them.
They count supply as the scheduler then did (``scheduler.supply=ready``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qwengyre.config import Config, load_config
from qwengyre.scheduler.core import GroupState, Scheduler
from qwengyre.scheduler.events import Role
from qwengyre.sim.simulator import SimCosts, SimResult, Simulation
from qwengyre.sim.workload import ExecutionSpec, FixedWorkload, Workload, _mix64
from qwengyre.types import Outcome

STEPS = 10
SHAPES = {
    2: ["cells.capacity=8", "groups.batch=4"],
    8: ["cells.capacity=8", "groups.batch=8"],
    80: ["cells.capacity=2", "groups.batch=16"],
}
BURSTS = {
    "elastic": ["scheduler.mu=2", "scheduler.phi=0.5"],
    "async": ["scheduler.mu=1", "scheduler.phi=1"],
    "colocate": ["scheduler.mu=3", "scheduler.phi=0"],
}


@dataclass(frozen=True)
class _Hashed:
    """Durations 600-6000 s, one execution in 13 without a valid reward: all hashed."""

    name: str = "hashed"

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        h = _mix64(17, query_id, index)
        invalid = h % 13 == 0
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=600.0 + h % 5400,
            outcome=Outcome.OVERALL_TIMEOUT if invalid else Outcome.COMPLETED,
            reward=None if invalid else float(h >> 63),
            train_tokens=0 if invalid else 40_000 + h % 80_000,
        )


def _config(cells: int, policy: str, extra: tuple[str, ...]) -> Config:
    return load_config(
        None,
        [
            "groups.size=4",
            f"cells.count={cells}",
            f"scheduler.policy={policy}",
            "scheduler.supply=ready",
            *SHAPES[cells],
            *BURSTS[policy],
            f"scheduler.async_training_cells={max(1, cells // 4)}",
            "sim.train_tokens_per_cell_s=40000",
            *extra,
        ],
    )


def _run(cells: int, policy: str, workload: Workload, extra: tuple[str, ...]) -> tuple:
    config = _config(cells, policy, extra)
    params, costs = config.scheduler_params(), SimCosts.from_config(config)
    r = Simulation(params, costs, workload, STEPS).run()
    return (
        r.end_to_end_s,
        r.launched,
        r.cancelled,
        r.groups_dropped,
        r.reroutes,
        len(r.role_spans),
        len(r.load),
        r.rollout_utilisation,
        r.mean_staleness_all,
        sum(r.cell_training_share),
    )


FIXED = FixedWorkload(duration_s=1800.0, train_tokens=60_000)
# (cells, policy, workload, overrides) -> (end-to-end s, launched, cancelled, dropped,
# reroutes, role spans, load samples, rollout utilisation, mean staleness, training share)
PINNED = [
    (2, "elastic", FIXED, (), (19016.44, 168, 0, 0, 0, 20, 27, 1.0, 0.9, 0.05048263502527287)),
    (2, "async", FIXED, (), (36072.0, 168, 0, 0, 0, 2, 30, 1.0, 0.9, 1.0)),
    (2, "colocate", FIXED, (), (22454.46, 192, 0, 0, 0, 30, 19, 1.0, 0.9, 0.07214602355166858)),
    (
        8,
        "elastic",
        FIXED,
        (),
        (10272.600000000002, 336, 0, 0, 32, 26, 23, 0.9211713259147181, 0.9, 0.11681560656503716),
    ),
    (8, "async", FIXED, (), (12990.0, 352, 0, 0, 0, 8, 27, 0.9710546574287914, 0.9, 2.0)),
    (8, "colocate", FIXED, (), (15194.46, 384, 0, 0, 0, 120, 15, 0.75, 0.9, 0.3948807657527809)),
    (
        80,
        "elastic",
        FIXED,
        (),
        (10341.12, 672, 0, 0, 0, 100, 20, 0.7392160623436836, 0.9, 0.8761720200519866),
    ),
    (80, "async", FIXED, (), (12954.0, 704, 0, 0, 0, 80, 17, 0.805187586845762, 0.9, 20.0)),
    (80, "colocate", FIXED, (), (15194.46, 768, 0, 0, 0, 1200, 15, 0.6, 0.9, 3.948807657527809)),
    (
        8,
        "elastic",
        _Hashed(),
        ("groups.reserve=4", "groups.min_valid=2"),
        (27373.856, 336, 0, 0, 32, 26, 342, 0.6882805032298063, 0.9, 0.6371509954607782),
    ),
    (
        8,
        "async",
        _Hashed(),
        ("scheduler.dispatch=continuous", "groups.oversample=2"),
        (31885.796625, 541, 132, 0, 0, 8, 357, 1.0, 1.7, 2.0),
    ),
    (
        8,
        "colocate",
        _Hashed(),
        ("scheduler.streaming=false",),
        (
            39230.24867499999,
            419,
            0,
            1,
            0,
            184,
            427,
            0.5605834954562072,
            1.2875,
            0.17697133295064346,
        ),
    ),
    (
        80,
        "elastic",
        _Hashed(),
        ("groups.oversample=1",),
        (27704.00595, 851, 122, 0, 9, 98, 713, 0.6218770863114268, 0.8875, 0.7492203830543863),
    ),
    (
        80,
        "colocate",
        _Hashed(),
        ("groups.min_valid=3",),
        (32871.97599999999, 774, 0, 0, 0, 1520, 771, 0.5038327349359976, 1.2, 1.911746345884393),
    ),
]


@pytest.mark.parametrize(
    ("cells", "policy", "workload", "extra", "expected"),
    PINNED,
    ids=[f"K{c}-{p}-{w.name}{'-' if x else ''}{'-'.join(x)}" for c, p, w, x, _ in PINNED],
)
def test_runs_without_random_draws_are_unchanged(
    cells: int, policy: str, workload: Workload, extra: tuple[str, ...], expected: tuple
):
    assert _run(cells, policy, workload, extra) == expected


class _Recounted(Simulation):
    """Before every settle, the scheduler's incrementally kept views are recounted."""

    checks = most_reserved = 0

    def _settle(self) -> None:
        _recount(self.scheduler)
        self.checks += 1
        self.most_reserved = max(self.most_reserved, self.scheduler.counters.reserved)
        super()._settle()


def _recount(s: Scheduler) -> None:
    p = s.params
    training = tuple(c for c, r in enumerate(s.roles) if r is Role.TRAINING)
    serving = sum(r is Role.ROLLOUT for r in s.roles)
    assert s.training_cells == training
    assert s.capacity == serving * p.cell_capacity + p.standalone_capacity
    could_need = sum(
        max(0, p.executions_per_group + p.max_topups - len(g.executions) - g.owed)
        for g in s.groups.values()
        if g.state is GroupState.ROLLOUT
    )
    assert s.counters.reserved == min(s._reserve_left, could_need)


@pytest.mark.parametrize(
    ("cells", "policy", "extra"),
    [
        (8, "elastic", ("groups.reserve=6", "groups.min_valid=3", "groups.oversample=1")),
        (80, "elastic", ("groups.reserve=6",)),
        (80, "colocate", ("cells.standalone_capacity=3",)),
        (8, "async", ("groups.reserve=2", "groups.min_valid=4")),
    ],
)
def test_incremental_views_match_a_recount_after_every_event(
    cells: int, policy: str, extra: tuple[str, ...]
):
    config = _config(cells, policy, extra)
    params, costs = config.scheduler_params(), SimCosts.from_config(config)
    sim = _Recounted(params, costs, _Hashed(), STEPS)
    result: SimResult = sim.run()
    assert sim.checks > 500 and result.launched > 0
    assert (sim.most_reserved > 0) == (params.reserve > 0)  # the reserve term was exercised
