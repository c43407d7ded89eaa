"""The simulator drives the real scheduler: staleness (Eq 2), continuous dispatch, bounds."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pytest

from qwengyre.config import Config, load_config, retarget
from qwengyre.scheduler.events import Role
from qwengyre.sim.compare import NON_STREAMING_ASYNC, NON_STREAMING_COLOCATE, compare_policies
from qwengyre.sim.search import Shape, shapes
from qwengyre.sim.simulator import SimCosts, Simulation, simulate
from qwengyre.sim.workload import ExecutionSpec, FixedWorkload, ParametricWorkload
from qwengyre.types import Outcome

SMALL = [
    "groups.size=4",
    "groups.batch=4",
    "cells.count=4",
    "cells.capacity=24",
    "sim.train_tokens_per_cell_s=40000",
]


def small(*overrides: str) -> Config:
    return load_config(None, [*SMALL, *overrides])


@pytest.mark.parametrize(
    ("policy", "mu", "phi"),
    [
        ("async", 1, 0.0),
        ("async", 1, 1.5),
        ("async", 2, 1.0),
        ("elastic", 3, 0.5),
        ("elastic", 2, 0.0),
        ("colocate", 3, 0.0),
    ],
)
def test_measured_staleness_matches_eq2_in_steady_state(policy: str, mu: int, phi: float):
    config = small(
        f"scheduler.policy={policy}",
        f"scheduler.mu={mu}",
        f"scheduler.phi={phi}",
        "sim.steps=60",
    )
    result = simulate(config, ParametricWorkload.paper_122b(seed=3))
    assert result.predicted_staleness == phi + (mu - 1) / 2
    assert result.mean_staleness == pytest.approx(result.predicted_staleness, abs=0.1)


def test_continuous_dispatch_steps_every_b_l_over_q():
    """Appendix: T_c = B * L / Q_c with ample capacity and instant training."""
    b, duration, depth = 4, 1000.0, 12  # Q_c = (phi + mu) * B = (2 + 1) * 4
    config = load_config(
        None,
        [
            "scheduler.policy=async",
            "scheduler.dispatch=continuous",
            "scheduler.phi=2",
            f"groups.batch={b}",
            "groups.size=2",
            "cells.count=2",
            "cells.capacity=1000",
            "scheduler.async_training_cells=1",
            "sim.publish_s=0",
            "sim.train_step_overhead_s=0",
            "sim.steps=60",
        ],
    )
    assert config.scheduler.phi + config.scheduler.mu == depth / b
    result = simulate(config, FixedWorkload(duration_s=duration, train_tokens=0))
    steady = result.step_end_s[-1] - result.step_end_s[9]
    t_c = steady / (len(result.step_end_s) - 10)
    assert t_c == pytest.approx(b * duration / depth, rel=0.05)


@pytest.mark.parametrize("policy", ["elastic", "async", "colocate"])
def test_every_run_respects_the_lower_bound_and_its_bookkeeping(policy: str):
    config = small(f"scheduler.policy={policy}", "scheduler.target_staleness=1", "sim.steps=12")
    result = simulate(config, ParametricWorkload.paper_122b(seed=1))
    assert result.end_to_end_s >= result.bound.seconds
    assert len(result.step_times_s) == 12 and all(t > 0 for t in result.step_times_s)
    assert 0 < result.rollout_utilisation <= 1
    assert all(0 <= share <= 1 for share in result.cell_training_share)
    # Role spans tile each cell's timeline without gaps or overlaps.
    for cell in range(4):
        spans = [s for s in result.role_spans if s.cell == cell]
        assert spans[0].start_s == 0
        assert all(a.end_s == b.start_s for a, b in itertools.pairwise(spans))
    trained = {s.cell for s in result.role_spans if s.role is Role.TRAINING}
    if policy == "async":
        assert trained == {0, 1}  # the fixed split
    elif policy == "colocate":
        assert trained == {0, 1, 2, 3}  # the whole pool
    else:
        assert 0 in trained  # the core first


def test_simulation_is_deterministic():
    config = small("scheduler.target_staleness=1.5", "sim.steps=6")
    a = simulate(config, ParametricWorkload.paper_122b(seed=5))
    b = simulate(config, ParametricWorkload.paper_122b(seed=5))
    assert a.summary() == b.summary()


def test_the_comparison_holds_the_best_baselines_and_the_papers_apart():
    """paper-122b's shape at a quarter of its size: 8 cells, B=8, capacity 36. Each
    baseline is the fastest of its shapes at the target, so no slower than that policy
    at the config's cells and Eq 2's default shape (the old baselines); the paper's
    non-streaming rows use that shape."""
    config = load_config(None, ["groups.batch=8", "cells.capacity=36", "sim.steps=24"])
    workload = ParametricWorkload.paper_122b(seed=0)
    comparison = compare_policies(config, workload, 1.5)
    summary = comparison.summary()["policies"]
    assert set(summary) == {
        "elastic", "async", NON_STREAMING_ASYNC, "colocate", NON_STREAMING_COLOCATE
    }  # fmt: skip
    for policy, paper_row in (("async", NON_STREAMING_ASYNC), ("colocate", NON_STREAMING_COLOCATE)):
        default = simulate(retarget(config, 1.5, policy), workload)
        assert comparison.results[policy].end_to_end_s <= default.end_to_end_s
        paper = comparison.results[paper_row]
        assert (paper.mu, paper.phi) == (default.mu, default.phi)
        assert summary["elastic"][f"speedup_vs_{paper_row}"] == comparison.speedup(paper_row)
    assert summary["async"]["note"].startswith("best of 28: ")
    assert summary["colocate"]["note"].startswith("best of 29: ")


def test_shapes_span_every_split_burst_and_standalone_pool():
    config = load_config(None, ["groups.batch=8"])
    bursts = {(1, 1.5), (2, 1.0), (3, 0.5), (4, 0.0)}
    async_shapes = shapes(config, 1.5, "async")
    assert {(s.mu, s.phi) for s in async_shapes} == bursts
    assert {s.training_cells for s in async_shapes} == set(range(1, 8))
    colocate = shapes(config, 1.5, "colocate")
    # Extra dispatch only with a standalone pool: mu 4 (phi 0) with 0..7 standalone
    # cells, and mu 1..3 with 1..7.
    assert len(colocate) == 8 + 3 * 7
    assert all(s.phi == 0 or s.standalone_cells for s in colocate)
    c1 = Shape(policy="colocate", mu=3, phi=0.5, standalone_cells=1).apply(config)
    assert (c1.cells.count, c1.cells.standalone_capacity) == (7, 144)
    assert c1.scheduler.phi == 0.5 and c1.scheduler.policy == "colocate"
    # B = 3 leaves out shapes whose queue depth is not whole: (phi + mu) B = 4.5 at mu 1.
    odd = load_config(None, ["groups.batch=3"])
    assert {(s.mu, s.phi) for s in shapes(odd, 0.5, "elastic")} == {(2, 0.0)}


@pytest.mark.parametrize("reserve", [0, 8])
@pytest.mark.parametrize(("policy", "mu", "phi"), [("elastic", 3, 0.5), ("async", 1, 1.5)])
def test_measured_staleness_matches_eq2_with_invalid_rewards(
    policy: str, mu: int, phi: float, reserve: int
):
    """paper-122b has evaluator failures and overall timeouts; with every group needing
    all N valid rewards each one is topped up (owed to the next boundary, or out of the
    reserve), and Eq 2 still holds: each group counts once, at its first dispatch."""
    config = small(
        f"scheduler.policy={policy}",
        f"scheduler.mu={mu}",
        f"scheduler.phi={phi}",
        f"groups.reserve={reserve}",
        "sim.steps=60",
    )
    workload = ParametricWorkload.paper_122b(seed=3)
    invalid = sum(not workload.execution(q, i).valid for q in range(60 * 4) for i in range(4))
    assert invalid > 0
    result = simulate(config, workload)
    assert result.mean_staleness == pytest.approx(result.predicted_staleness, abs=0.1)
    # Top-ups launched after a later publication sample newer weights.
    assert result.mean_execution_staleness <= result.mean_staleness


@dataclass(frozen=True)
class _OneGroupFails:
    """Every execution takes 1000 s; query 0's first N all end without a valid reward."""

    n: int
    name: str = "one-group-fails"

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        fails = query_id == 0 and index < self.n
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=1000.0,
            outcome=Outcome.OVERALL_TIMEOUT if fails else Outcome.COMPLETED,
            reward=None if fails else float(index % 2),
            train_tokens=1000,
        )


def test_colocate_trains_the_other_groups_instead_of_waiting_for_top_ups():
    """min_valid: group 0's executions all fail, so its shortfall is known only when its
    last one ends. The pool no longer waits for a top-up round (another 1000 s): it
    switches as soon as rollout is done, trains the other groups, and the burst ends
    early; group 0's top-up runs after the publication, and it trains later."""
    config = load_config(
        None,
        [
            "scheduler.policy=colocate",
            "scheduler.mu=2",
            "scheduler.phi=0",
            "groups.size=2",
            "groups.min_valid=1",
            "groups.batch=2",
            "cells.count=2",
            "cells.capacity=8",
            "sim.publish_s=0",
            "sim.train_step_overhead_s=1",
            "sim.steps=4",
        ],
    )
    sim = Simulation(config.scheduler_params(), SimCosts.from_config(config), _OneGroupFails(2), 4)
    result = sim.run()
    assert result.step_end_s[0] < 1500  # trained before a top-up round could end
    assert result.groups_dropped == 0
    first = {g.group_id: g for g in sim.scheduler.consumed()}[0]
    assert first.v_d == 0 and first.v_t >= 1  # trained in a later batch


def test_stalled_bursts_are_counted_where_invalid_results_outrun_the_extra_groups():
    """Without extra groups (phi = 0) and with most evaluations invalid, short groups stall
    bursts, which dispatch their owed top-ups mid-burst; every result valid, none does."""
    config = small("scheduler.mu=2", "scheduler.phi=0", "groups.min_valid=null", "sim.steps=20")
    flaky = dataclasses.replace(ParametricWorkload.paper_122b(seed=4), eval_failure_prob=0.6)
    stalled = simulate(config, flaky)
    assert stalled.stalls > 0
    assert stalled.summary()["stalled_dispatches"] == stalled.stalls
    valid = dataclasses.replace(flaky, eval_failure_prob=0.0)
    assert simulate(config, valid).stalls == 0
