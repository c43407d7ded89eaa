"""Workload models: determinism, the paper presets' statistics, reward validity, registry."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.traces import write_trace

from qwengyre.records.trace import TraceRecord
from qwengyre.sim.replay import TraceWorkload
from qwengyre.sim.workload import (
    WORKLOAD_NAMES,
    ExecutionSpec,
    FixedWorkload,
    ParametricDraws,
    ParametricWorkload,
    Workload,
    block_stats,
    paper_2p4t,
    paper_122b,
    workload_from_name,
    workload_stats,
)
from qwengyre.types import Outcome

TEST_SEED = 4242
# Queries the presets' statistics are measured on: the standard error of the share of
# >= 4 h queries is then 0.55 points (2p4t), a fifth of the tolerance asserted.
STATS_QUERIES = 8000


@pytest.fixture(scope="module")
def stats_122b():
    return workload_stats(paper_122b(TEST_SEED), STATS_QUERIES)


@pytest.fixture(scope="module")
def stats_2p4t():
    return workload_stats(paper_2p4t(TEST_SEED), STATS_QUERIES)


# -- determinism ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [paper_122b, paper_2p4t])
def test_same_seed_query_index_gives_same_spec_in_any_order(make):
    # across query blocks (64 queries) and index chunks (16 indices) of the draws
    keys = [(q, i) for q in [*range(6), *range(60, 68)] for i in range(12, 20)]
    keys += [(10**9, 0), (10**9, 37)]
    forward = {key: make(7).execution(*key) for key in keys}
    shuffled = list(keys)
    random.Random(3).shuffle(shuffled)
    other = make(7)  # a fresh instance: nothing may be cached across calls
    backward = {key: other.execution(*key) for key in shuffled}
    assert forward == backward
    assert make(8).execution(3, 14) != forward[(3, 14)]  # the seed matters


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    query_id=st.integers(0, 10**9),
    index=st.integers(0, 10**4),
)
def test_execution_is_a_pure_function_and_well_formed(seed, query_id, index):
    workload = paper_122b(seed)
    spec = workload.execution(query_id, index)
    assert spec == workload.execution(query_id, index)
    assert (spec.query_id, spec.index) == (query_id, index)
    assert 0.0 < spec.duration_s <= workload.overall_budget_h * 3600.0
    assert spec.outcome is not Outcome.CANCELLED
    assert spec.valid == (spec.reward is not None)


def test_executions_of_one_query_share_its_difficulty():
    # Latent per-query difficulty: the spread between query means dwarfs what independent
    # executions would give.
    workload = paper_122b(11)
    durations = np.array(
        [[workload.execution(q, i).duration_s for i in range(16)] for q in range(200)]
    )
    within = durations.std(axis=1, ddof=1).mean()
    between = durations.mean(axis=1).std(ddof=1)
    assert between > 1.5 * within / math.sqrt(16)


def test_query_stream_is_no_execution_stream():
    # default_rng([seed, b]) is the same stream as default_rng([seed, b, 0]) (zero padding);
    # the queries' difficulties must not reuse any execution tile's random numbers.
    from qwengyre.sim.workload import _execution_tile_rng, _query_block_rng

    for block in range(5):
        query_bits = _query_block_rng(9, block).random(8)
        for chunk in range(3):
            assert not np.allclose(query_bits, _execution_tile_rng(9, block, chunk).random(8))
    assert np.allclose(
        np.random.default_rng([9, 2]).random(8), np.random.default_rng([9, 2, 0]).random(8)
    )


def test_sampled_draws_are_the_ones_execution_uses():
    """A sample straddling query blocks and index chunks is cut from the same tiles."""
    workload = paper_122b(5)
    draws = ParametricDraws.sample(5, n_queries=10, n_per_query=20, first_query=60)
    block = workload.simulate(draws)
    assert draws.query_ids.tolist() == list(range(60, 70))
    for row, query_id in enumerate(range(60, 70)):
        for index in range(20):
            spec = workload.execution(query_id, index)
            assert spec.duration_s == block.duration_h[row, index] * 3600.0
            assert spec.train_tokens == block.train_tokens[row, index]


def test_vectorised_statistics_match_execution_by_execution():
    workload = paper_2p4t(3)

    class Slow:  # forces workload_stats through execution()
        name = "slow"

        def execution(self, query_id: int, index: int) -> ExecutionSpec:
            return workload.execution(query_id, index)

    slow = dataclasses.asdict(workload_stats(Slow(), 40))
    fast = dataclasses.asdict(workload_stats(workload, 40))
    assert slow == pytest.approx(fast, rel=1e-9, nan_ok=True)
    assert fast["overall_timeout_rate"] > 0.0  # the comparison covers every outcome


# -- the presets against the paper ----------------------------------------------------


def test_paper_122b_means(stats_122b):
    assert stats_122b.mean_execution_h == pytest.approx(1.93, abs=0.1)
    assert stats_122b.mean_query_h == pytest.approx(2.96, abs=0.1)


def test_paper_122b_query_tail(stats_122b):
    assert stats_122b.frac_queries_ge_4h == pytest.approx(0.0951, abs=0.02)


def test_paper_122b_timeout_rates(stats_122b):
    assert stats_122b.harness_timeout_rate == pytest.approx(0.0625, abs=0.02)
    assert stats_122b.overall_timeout_rate == pytest.approx(0.0087, abs=0.005)


def test_paper_2p4t_targets(stats_2p4t, stats_122b):
    assert stats_2p4t.frac_queries_ge_4h == pytest.approx(0.611, abs=0.03)
    assert stats_2p4t.frac_long_queries_ending_overall_timeout == pytest.approx(0.382, abs=0.04)
    # the paper: a higher timeout rate than 122B even with the extended limit
    timeouts_2p4t = stats_2p4t.harness_timeout_rate + stats_2p4t.overall_timeout_rate
    timeouts_122b = stats_122b.harness_timeout_rate + stats_122b.overall_timeout_rate
    assert timeouts_2p4t > timeouts_122b
    assert paper_2p4t().harness_deadline_h > paper_122b().harness_deadline_h


@pytest.mark.parametrize("stats_name", ["stats_122b", "stats_2p4t"])
def test_train_tokens_in_documented_range(stats_name, request):
    stats = request.getfixturevalue(stats_name)
    assert 60_000 <= stats.mean_train_tokens <= 150_000


def test_presets_carry_their_registry_names():
    assert paper_122b().name == "paper-122b"
    assert paper_2p4t().name == "paper-2p4t"
    assert ParametricWorkload.paper_122b(5) == paper_122b(5)


# -- validity of rewards ----------------------------------------------------------------


@pytest.fixture(scope="module")
def specs_2p4t():
    # the 2.4T preset has ~5% overall timeouts: plenty of every outcome
    workload = paper_2p4t(99)
    return [workload.execution(q, i) for q in range(150) for i in range(16)]


def test_overall_timeout_iff_reward_missing(specs_2p4t):
    outcomes = {spec.outcome for spec in specs_2p4t}
    assert Outcome.OVERALL_TIMEOUT in outcomes and Outcome.COMPLETED in outcomes
    for spec in specs_2p4t:
        assert (spec.outcome is Outcome.OVERALL_TIMEOUT) == (spec.reward is None)
        assert spec.valid == (spec.outcome is not Outcome.OVERALL_TIMEOUT)


def test_overall_timeout_ends_at_the_budget_and_trains_nothing(specs_2p4t):
    budget_s = paper_2p4t().overall_budget_h * 3600.0
    timed_out = [s for s in specs_2p4t if s.outcome is Outcome.OVERALL_TIMEOUT]
    assert timed_out
    assert all(s.duration_s == pytest.approx(budget_s) for s in timed_out)
    assert all(s.train_tokens == 0 for s in timed_out)
    assert all(s.duration_s < budget_s for s in specs_2p4t if s.valid)


def test_harness_timeouts_are_scored(specs_2p4t):
    deadline_s = paper_2p4t().harness_deadline_h * 3600.0
    cut = [s for s in specs_2p4t if s.outcome is Outcome.HARNESS_TIMEOUT]
    assert cut
    assert all(s.reward in (0.0, 1.0) for s in cut)
    assert all(s.duration_s > deadline_s for s in cut)  # deadline + evaluation
    assert all(s.train_tokens > 0 for s in cut)


def test_harness_timeout_rewards_are_lower_but_not_all_zero():
    # Equal pass rates for every query, so only the outcome can make the difference.
    workload = dataclasses.replace(
        paper_2p4t(99), pass_logit_sigma=0.0, pass_difficulty_slope=0.0, partial_reward_factor=0.3
    )
    specs = [workload.execution(q, i) for q in range(150) for i in range(16)]

    def mean_reward(outcome: Outcome) -> float:
        rewards = [s.reward for s in specs if s.outcome is outcome and s.reward is not None]
        assert len(rewards) > 100
        return sum(rewards) / len(rewards)

    assert 0.05 < mean_reward(Outcome.HARNESS_TIMEOUT) < 0.25  # 0.5 * 0.3
    assert 0.45 < mean_reward(Outcome.COMPLETED) < 0.55


def test_no_zero_reward_stands_in_for_missing_one():
    # Even when every evaluation attempt fails (a budget too small for one attempt),
    # the reward is None, never 0.0.
    workload = dataclasses.replace(paper_122b(1), overall_budget_h=3.01, eval_median_h=5.0)
    specs = [workload.execution(q, i) for q in range(20) for i in range(4)]
    assert all(spec.outcome is Outcome.OVERALL_TIMEOUT for spec in specs)
    assert all(spec.reward is None and not spec.valid for spec in specs)


def test_evaluator_failures_become_overall_timeouts_only_when_budget_runs_out():
    generous = dataclasses.replace(paper_122b(2), overall_budget_h=1000.0)
    stats = workload_stats(generous, 300)
    assert stats.overall_timeout_rate == 0.0
    flaky = dataclasses.replace(paper_122b(2), eval_failure_prob=0.9, eval_failure_slope=0.0)
    assert workload_stats(flaky, 300).overall_timeout_rate > 0.05


def test_execution_spec_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="no valid reward"):
        ExecutionSpec(
            query_id=0,
            index=0,
            duration_s=10.0,
            outcome=Outcome.OVERALL_TIMEOUT,
            reward=0.0,
            train_tokens=0,
        )
    with pytest.raises(ValueError, match="completed"):
        ExecutionSpec(
            query_id=0,
            index=0,
            duration_s=10.0,
            outcome=Outcome.COMPLETED,
            reward=None,
            train_tokens=0,
        )
    with pytest.raises(ValueError, match="cancel"):
        ExecutionSpec(
            query_id=0,
            index=0,
            duration_s=10.0,
            outcome=Outcome.CANCELLED,
            reward=None,
            train_tokens=0,
        )
    with pytest.raises(ValueError, match="duration"):
        ExecutionSpec(
            query_id=0, index=0, duration_s=-1.0, outcome=Outcome.FAILED, reward=0.0, train_tokens=0
        )
    with pytest.raises(ValueError, match="train_tokens"):
        ExecutionSpec(
            query_id=0, index=0, duration_s=1.0, outcome=Outcome.FAILED, reward=0.0, train_tokens=-5
        )


def test_parametric_workload_rejects_deadline_beyond_budget():
    with pytest.raises(ValueError, match="harness_deadline_h"):
        ParametricWorkload(harness_deadline_h=5.0, overall_budget_h=4.0)
    with pytest.raises(ValueError, match="seed"):
        ParametricWorkload(seed=-1)


def test_block_stats_counts_long_queries_ending_with_overall_timeout():
    duration_h = np.array([[1.0, 5.0], [4.5, 1.0], [1.0, 2.0]])
    code = np.array([[0, 3], [2, 0], [0, 0]], dtype=np.int8)
    reward = np.array([[1.0, np.nan], [0.0, 1.0], [1.0, 0.0]])
    tokens = np.array([[10, 0], [20, 30], [40, 50]], dtype=np.int64)
    from qwengyre.sim.workload import SimulatedBlock

    stats = block_stats(SimulatedBlock(duration_h, code, reward, tokens))
    assert stats.frac_queries_ge_4h == pytest.approx(2 / 3)
    assert stats.frac_long_queries_ending_overall_timeout == pytest.approx(0.5)
    assert stats.mean_query_h == pytest.approx((5.0 + 4.5 + 2.0) / 3)
    assert stats.overall_timeout_rate == pytest.approx(1 / 6)
    assert stats.harness_timeout_rate == pytest.approx(1 / 6)
    assert stats.mean_train_tokens == pytest.approx((10 + 20 + 30 + 40 + 50) / 5)


# -- FixedWorkload ------------------------------------------------------------------------


def test_fixed_workload_durations_and_validity():
    workload = FixedWorkload(duration_s=1234.5, train_tokens=777)
    specs = [workload.execution(q, i) for q in range(10) for i in range(16)]
    assert all(s.duration_s == 1234.5 for s in specs)
    assert all(s.outcome is Outcome.COMPLETED and s.valid for s in specs)
    assert all(s.train_tokens == 777 for s in specs)


def test_fixed_workload_rewards_vary_within_groups_deterministically():
    workload = FixedWorkload(duration_s=60.0, seed=3)
    for query_id in range(20):
        rewards = [workload.execution(query_id, i).reward for i in range(16)]
        assert set(rewards) == {0.0, 1.0}
        assert rewards == [
            FixedWorkload(duration_s=60.0, seed=3).execution(query_id, i).reward for i in range(16)
        ]
    everywhere = [workload.execution(q, i).reward or 0.0 for q in range(200) for i in range(16)]
    assert 0.45 < sum(everywhere) / len(everywhere) < 0.55


def test_fixed_workload_constant_reward():
    workload = FixedWorkload(duration_s=60.0, reward=0.25)
    assert {workload.execution(q, i).reward for q in range(5) for i in range(5)} == {0.25}


# -- registry -------------------------------------------------------------------------------


def test_registry_builds_each_name(tmp_path: Path):
    assert workload_from_name("paper-122b", seed=4) == paper_122b(4)
    assert workload_from_name("paper-2p4t", seed=4) == paper_2p4t(4)
    fixed = workload_from_name("fixed", seed=4)
    assert isinstance(fixed, FixedWorkload) and fixed.duration_s == 3600.0
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        [
            TraceRecord(
                query="q", group=0, index=0, start_s=0.0, end_s=9.0, outcome="completed", reward=1.0
            )
        ],
    )
    replay = workload_from_name("trace", seed=0, trace=trace)
    assert isinstance(replay, TraceWorkload)
    assert replay.execution(0, 0).duration_s == 9.0
    for name in WORKLOAD_NAMES:
        built = workload_from_name(name, 0, trace if name == "trace" else None)
        assert isinstance(built, Workload)
        assert built.name == name


def test_registry_rejects_unknown_name_listing_allowed():
    with pytest.raises(ValueError, match="'paper-7b'") as info:
        workload_from_name("paper-7b", 0)
    for name in WORKLOAD_NAMES:
        assert name in str(info.value)


def test_registry_trace_path_rules(tmp_path: Path):
    with pytest.raises(ValueError, match="requires a trace path"):
        workload_from_name("trace", 0)
    with pytest.raises(FileNotFoundError):
        workload_from_name("trace", 0, tmp_path / "missing.jsonl")
    # other workloads ignore a trace path left in the config
    assert workload_from_name("fixed", 0, tmp_path / "x.jsonl") == FixedWorkload(duration_s=3600.0)
