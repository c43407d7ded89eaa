"""Workload models: what each execution launched by the simulated scheduler does.

A *workload* answers one question for the simulator: when execution ``index`` of query
``query_id`` is launched, how long does it run, how does it terminate, what valid reward
(if any) does it obtain, and how many tokens does it contribute to training.  Answers
are deterministic functions of ``(seed, query_id, index)``: they do not depend on the
order in which the simulator asks, so a scheduler policy can be compared with another on
exactly the same executions (common random numbers).

Three workloads exist:

- :class:`ParametricWorkload`: a generative model of long-horizon agent executions
  (per-query difficulty, harness deadline, evaluation with retries inside an overall
  budget), with two presets fitted to the paper's NL2RepoBench measurements,
  :func:`paper_122b` and :func:`paper_2p4t`;
- :class:`FixedWorkload`: every execution takes the same time and completes validly;
- :class:`qwengyre.sim.replay.TraceWorkload`: replays a recorded JSONL trace.

:func:`workload_from_name` builds one from its registry name; :func:`workload_stats`
measures the statistics the presets were fitted to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from qwengyre.types import Outcome

SECONDS_PER_HOUR = 3600.0
#: A query (rollout group) is "long" when its longest execution takes at least this long;
#: the threshold of the paper's Figures 5 and 8.
LONG_QUERY_S = 4.0 * SECONDS_PER_HOUR
#: Executions per rollout group used by the paper and by :func:`workload_stats`.
DEFAULT_GROUP_SIZE = 16

# Outcome codes of the vectorised model, in this order.
_CODE_OUTCOMES: tuple[Outcome, ...] = (
    Outcome.COMPLETED,
    Outcome.FAILED,
    Outcome.HARNESS_TIMEOUT,
    Outcome.OVERALL_TIMEOUT,
)
_COMPLETED, _FAILED, _HARNESS_TIMEOUT, _OVERALL_TIMEOUT = range(4)


@dataclass(kw_only=True, frozen=True)
class ExecutionSpec:
    """What one launched execution does, as the workload decides it.

    ``duration_s`` runs from launch to termination: the harness run plus evaluation,
    evaluator retries included.  ``outcome`` is never ``cancelled`` (cancelling is the
    scheduler's doing).  ``reward`` is the valid reward, ``None`` exactly when no valid
    assessment exists: always for ``overall_timeout``, never for ``completed``; a
    missing reward is never represented by ``0.0``.  ``train_tokens`` counts the
    target tokens the execution contributes to training after trajectory selection
    (``0`` when it contributes nothing, e.g. after an overall timeout).
    """

    query_id: int
    index: int
    duration_s: float
    outcome: Outcome
    reward: float | None
    train_tokens: int

    def __post_init__(self) -> None:
        outcome = Outcome(self.outcome)
        object.__setattr__(self, "outcome", outcome)
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if not (math.isfinite(self.duration_s) and self.duration_s >= 0.0):
            raise ValueError(f"duration_s must be finite and >= 0, got {self.duration_s}")
        if outcome is Outcome.CANCELLED:
            raise ValueError("a workload never cancels an execution; that is the scheduler's")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite or None, got {self.reward}")
        if outcome is Outcome.OVERALL_TIMEOUT and self.reward is not None:
            raise ValueError("an overall_timeout execution has no valid reward (reward=None)")
        if outcome is Outcome.COMPLETED and self.reward is None:
            raise ValueError("a completed execution has a valid reward")
        if self.train_tokens < 0:
            raise ValueError(f"train_tokens must be >= 0, got {self.train_tokens}")

    @property
    def valid(self) -> bool:
        """Whether a valid assessment exists, i.e. the execution can count in its group."""
        return self.reward is not None


@runtime_checkable
class Workload(Protocol):
    """What the simulator asks about each launched execution.

    ``execution`` must be a pure function of its arguments (and the workload's own
    parameters and seed): asking twice, or in another order, gives the same spec.
    ``index`` may exceed N - 1 under oversampling.
    """

    @property
    def name(self) -> str: ...

    def execution(self, query_id: int, index: int) -> ExecutionSpec: ...


# --------------------------------------------------------------------------------------
# Random draws.  The parametric model is a deterministic transform of standard random
# variates, drawn a tile at a time: queries are cut into blocks of ``QUERY_BLOCK`` and
# execution indices into chunks of ``INDEX_CHUNK``.  The query variates of block b come
# from ``default_rng([seed, b, 1])`` and the execution variates of (block b, chunk c)
# from ``default_rng([seed, b, c, 2])``, each as one array: a variate depends only on
# (seed, query_id, index), whatever else is drawn or asked first.  (The trailing tag is
# never 0: ``SeedSequence`` pads short entropy with zeros, so ``[seed, b, 1]`` is
# ``[seed, b, 1, 0]``, which no execution stream can equal.)

QUERY_BLOCK = 64
INDEX_CHUNK = 16


def _query_block_rng(seed: int, block: int) -> np.random.Generator:
    return np.random.default_rng([seed, block, 1])


def _execution_tile_rng(seed: int, block: int, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, block, chunk, 2])


@dataclass(kw_only=True, frozen=True)
class ParametricDraws:
    """Standard random variates for a block of queries x executions.

    ``query_normal[q]`` = (difficulty z, pass-rate noise); ``exec_uniform[q, i]`` =
    (crash, crash point, evaluator failures, reward); ``exec_normal[q, i]`` = (harness
    time, evaluation attempt time, tokens).  Built once and transformed many times by
    :meth:`ParametricWorkload.simulate` (the fitting script relies on this).
    """

    seed: int
    query_ids: NDArray[np.int64]
    n_per_query: int
    query_normal: NDArray[np.float64]  # (Q, 2)
    exec_uniform: NDArray[np.float64]  # (Q, n, 4), each in [0, 1)
    exec_normal: NDArray[np.float64]  # (Q, n, 3)

    @classmethod
    def sample(
        cls, seed: int, n_queries: int, n_per_query: int = DEFAULT_GROUP_SIZE, first_query: int = 0
    ) -> ParametricDraws:
        """The variates of queries ``first_query ..`` and executions ``0 .. n_per_query-1``."""
        if n_queries < 1 or n_per_query < 1 or first_query < 0:
            raise ValueError("n_queries and n_per_query must be >= 1, first_query >= 0")
        stop = first_query + n_queries
        blocks = range(first_query // QUERY_BLOCK, (stop - 1) // QUERY_BLOCK + 1)
        chunks = range((n_per_query - 1) // INDEX_CHUNK + 1)
        tiles = [[cls.tile(seed, block, chunk) for chunk in chunks] for block in blocks]
        start = first_query - blocks[0] * QUERY_BLOCK
        rows = slice(start, start + n_queries)
        uniform = [[tile.exec_uniform for tile in row] for row in tiles]
        normal = [[tile.exec_normal for tile in row] for row in tiles]
        return cls(
            seed=seed,
            query_ids=np.arange(first_query, stop, dtype=np.int64),
            n_per_query=n_per_query,
            query_normal=np.concatenate([row[0].query_normal for row in tiles])[rows],
            exec_uniform=_assemble(uniform, rows, n_per_query),
            exec_normal=_assemble(normal, rows, n_per_query),
        )

    @classmethod
    def tile(cls, seed: int, block: int, chunk: int) -> ParametricDraws:
        """The variates of query block ``block`` x index chunk ``chunk`` (QUERY_BLOCK
        queries from ``block * QUERY_BLOCK``, INDEX_CHUNK indices from ``chunk *
        INDEX_CHUNK``): the unit in which every variate is drawn."""
        rng = _execution_tile_rng(seed, block, chunk)
        shape = (QUERY_BLOCK, INDEX_CHUNK)
        return cls(
            seed=seed,
            query_ids=np.arange(block * QUERY_BLOCK, (block + 1) * QUERY_BLOCK, dtype=np.int64),
            n_per_query=INDEX_CHUNK,
            query_normal=_query_block_rng(seed, block).standard_normal((QUERY_BLOCK, 2)),
            exec_uniform=rng.random((*shape, 4)),
            exec_normal=rng.standard_normal((*shape, 3)),
        )


def _assemble(
    grid: list[list[NDArray[np.float64]]], rows: slice, columns: int
) -> NDArray[np.float64]:
    """Tiles laid out as ``grid`` (query blocks x index chunks), cut to rows x columns."""
    return np.concatenate([np.concatenate(row, axis=1) for row in grid])[rows, :columns]


@dataclass(frozen=True)
class SimulatedBlock:
    """The model's answers for a block of queries x executions (arrays of shape (Q, n))."""

    duration_h: NDArray[np.float64]
    outcome_code: NDArray[np.int8]  # index into (completed, failed, harness_timeout, overall)
    reward: NDArray[np.float64]  # NaN where no valid reward
    train_tokens: NDArray[np.int64]


def _sigmoid(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.asarray(1.0 / (1.0 + np.exp(-x)), dtype=np.float64)


@dataclass(kw_only=True, frozen=True)
class ParametricWorkload:
    """A generative model of long-horizon agent executions (durations in hours).

    Per query q (its block's query variates): a latent difficulty ``z_q ~ N(0, 1)``, so the
    query's median harness run time is ``harness_median_h * exp(query_sigma * z_q)``, and
    a pass rate ``p_q = sigmoid(pass_logit_mean + pass_logit_sigma * n_q -
    pass_difficulty_slope * z_q)``.  Executions of one query share ``z_q``: the paper's
    tails are per query.

    Per execution (q, i) (its tile's execution variates; see :meth:`ParametricDraws.tile`):

    1. harness run time ``h = median_q * exp(exec_sigma * e_i)``;
    2. with probability ``crash_prob`` the harness or its workspace fails at a uniform
       point of ``min(h, deadline)``: outcome ``failed``; otherwise, if ``h`` reaches
       ``harness_deadline_h`` the harness is cut there: ``harness_timeout``; otherwise
       ``completed``.  In every case the preserved work is then evaluated;
    3. evaluation: each attempt takes ``t = eval_median_h * exp(eval_sigma * e'_i)``
       (the same for all attempts of one execution) and fails (no valid score) with
       probability ``f_q = sigmoid(logit(eval_failure_prob) + eval_failure_slope * z_q)``;
       attempts repeat until one succeeds.  Failed attempts are geometric, drawn from
       one uniform, so the model needs no cap on retries;
    4. if ``h + attempts * t`` exceeds ``overall_budget_h`` before a valid score exists,
       the execution ends at the budget: ``overall_timeout``, reward ``None``,
       ``train_tokens = 0`` (its trajectories are discarded from training);
    5. reward: Bernoulli(``p_q``) for ``completed``; Bernoulli(``p_q *
       partial_reward_factor``) for ``harness_timeout`` and ``failed`` (partial work is
       scored and more often 0, but still a valid reward);
    6. ``train_tokens = tokens_median * (run hours) ** tokens_time_elasticity *
       exp(tokens_sigma * e''_i)``, rounded: the target tokens of the at most J_max = 5
       admitted trajectories, growing with the run time.

    Outcomes are exclusive: an execution cut by the harness deadline whose evaluation
    then exhausts the budget counts as ``overall_timeout`` only.  ``eval_failure_slope``
    > 0 makes evaluator failures more frequent on difficult queries (bigger generated
    repositories), which concentrates overall timeouts in the long queries.
    """

    seed: int = 0
    name: str = "parametric"
    # durations (hours)
    harness_median_h: float = 1.5  # median harness run time of the median query
    query_sigma: float = 0.5  # log-sd of the per-query median (latent difficulty)
    exec_sigma: float = 0.3  # log-sd of one execution's run around its query's median
    harness_deadline_h: float = 4.0  # the harness is cut here (harness_timeout)
    overall_budget_h: float = 5.0  # launch -> valid reward must fit (else overall_timeout)
    # evaluation
    eval_median_h: float = 0.2  # median time of one evaluation attempt
    eval_sigma: float = 0.3  # log-sd of the attempt time, per execution
    eval_failure_prob: float = 0.1  # per-attempt evaluator failure, median query
    eval_failure_slope: float = 0.0  # logit of that failure per sd of query difficulty
    # not measured in the paper; illustrative defaults kept by both presets
    crash_prob: float = 0.01  # harness/workspace failure (outcome failed)
    pass_logit_mean: float = 0.0  # pass rate of the median query: sigmoid(0) = 0.5
    pass_logit_sigma: float = 1.5  # spread of pass rates across queries
    pass_difficulty_slope: float = 0.5  # harder (longer) queries pass less often
    partial_reward_factor: float = 0.3  # pass-rate multiplier for cut or failed runs
    tokens_median: float = 80_000.0  # median train tokens of a 1 h run (scaled by presets)
    tokens_sigma: float = 0.5  # log-sd of train tokens
    tokens_time_elasticity: float = 0.5  # tokens grow as run_hours ** this
    # memoised answers: a tile's executions are modelled together, each spec built once
    _tiles: dict[tuple[int, int], SimulatedBlock] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _specs: dict[tuple[int, int], ExecutionSpec] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        positive = ("harness_median_h", "harness_deadline_h", "overall_budget_h")
        for name in positive:
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        nonnegative = (
            "query_sigma",
            "exec_sigma",
            "eval_median_h",
            "eval_sigma",
            "pass_logit_sigma",
            "tokens_median",
            "tokens_sigma",
            "tokens_time_elasticity",
        )
        for name in nonnegative:
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("crash_prob", "partial_reward_factor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.eval_failure_prob < 1.0:
            raise ValueError(f"eval_failure_prob must be in [0, 1), got {self.eval_failure_prob}")
        if self.harness_deadline_h >= self.overall_budget_h:
            raise ValueError(
                "harness_deadline_h must be below overall_budget_h "
                f"({self.harness_deadline_h} >= {self.overall_budget_h})"
            )

    # -- presets ---------------------------------------------------------------------

    @classmethod
    def paper_122b(cls, seed: int = 0) -> ParametricWorkload:
        """Qwen 3.6 122B on NL2RepoBench (paper, Figure 5); see :func:`paper_122b`."""
        return cls(seed=seed, name="paper-122b", **_PAPER_122B)

    @classmethod
    def paper_2p4t(cls, seed: int = 0) -> ParametricWorkload:
        """Qwen 3.8 2.4T on NL2RepoBench (paper, Figure 8); see :func:`paper_2p4t`."""
        return cls(seed=seed, name="paper-2p4t", **_PAPER_2P4T)

    # -- the model -------------------------------------------------------------------

    def simulate(self, draws: ParametricDraws) -> SimulatedBlock:
        """Transform standard variates into executions (vectorised; see the class doc)."""
        z = draws.query_normal[:, 0:1]
        pass_noise = draws.query_normal[:, 1:2]
        u_crash, u_point, u_eval, u_reward = np.moveaxis(draws.exec_uniform, -1, 0)
        e_harness, e_eval, e_tokens = np.moveaxis(draws.exec_normal, -1, 0)
        deadline, budget = self.harness_deadline_h, self.overall_budget_h

        harness = self.harness_median_h * np.exp(self.query_sigma * z + self.exec_sigma * e_harness)
        crashed = u_crash < self.crash_prob
        cut = ~crashed & (harness >= deadline)
        run = np.where(crashed, np.minimum(harness, deadline) * u_point, harness)
        run = np.where(cut, deadline, run)

        if self.eval_failure_prob > 0.0:
            logit_f = math.log(self.eval_failure_prob / (1.0 - self.eval_failure_prob))
            fail = np.minimum(_sigmoid(logit_f + self.eval_failure_slope * z), 1.0 - 1e-9)
            # failures before the first success ~ Geometric: P(k >= m) = f**m
            with np.errstate(divide="ignore"):
                failures = np.floor(np.log1p(-u_eval) / np.log(fail))
        else:
            failures = np.zeros_like(run)
        attempt = self.eval_median_h * np.exp(self.eval_sigma * e_eval)
        end = run + (failures + 1.0) * attempt
        overall = end > budget

        code = np.full(run.shape, _COMPLETED, dtype=np.int8)
        code[crashed] = _FAILED
        code[cut] = _HARNESS_TIMEOUT
        code[overall] = _OVERALL_TIMEOUT

        pass_rate = _sigmoid(
            self.pass_logit_mean
            + self.pass_logit_sigma * pass_noise
            - self.pass_difficulty_slope * z
        )
        pass_rate = np.where(code == _COMPLETED, pass_rate, pass_rate * self.partial_reward_factor)
        reward = np.where(overall, np.nan, (u_reward < pass_rate).astype(np.float64))
        tokens = self.tokens_median * run**self.tokens_time_elasticity
        tokens = tokens * np.exp(self.tokens_sigma * e_tokens)
        train_tokens = np.where(overall, 0, np.rint(tokens)).astype(np.int64)
        return SimulatedBlock(
            duration_h=np.where(overall, budget, end),
            outcome_code=code,
            reward=reward,
            train_tokens=train_tokens,
        )

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        """Execution ``index`` of query ``query_id``: a lookup in its tile, which is
        modelled whole (:meth:`ParametricDraws.tile`) the first time one of its
        executions is asked for."""
        if query_id < 0 or index < 0:
            raise ValueError(f"query_id and index must be >= 0, got ({query_id}, {index})")
        spec = self._specs.get((query_id, index))
        if spec is None:
            spec = self._specs[query_id, index] = self._lookup(query_id, index)
        return spec

    def _lookup(self, query_id: int, index: int) -> ExecutionSpec:
        block, row = divmod(query_id, QUERY_BLOCK)
        chunk, column = divmod(index, INDEX_CHUNK)
        tile = self._tiles.get((block, chunk))
        if tile is None:
            draws = ParametricDraws.tile(self.seed, block, chunk)
            tile = self._tiles[block, chunk] = self.simulate(draws)
        reward = float(tile.reward[row, column])
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=float(tile.duration_h[row, column]) * SECONDS_PER_HOUR,
            outcome=_CODE_OUTCOMES[int(tile.outcome_code[row, column])],
            reward=None if math.isnan(reward) else reward,
            train_tokens=int(tile.train_tokens[row, column]),
        )


# Fitted by ``python benchmarks/fit_workloads.py`` (4000 queries x 16 executions, seed
# 20260101; search and targets in that script; ``--check`` reprints the table), on the
# per-execution random streams that preceded the tiles; the figures in the docstrings
# below are the presets' on today's draws, measured over 64,000 queries.  The
# 122B deadline (3 h) and budget (5 h) and the 2.4T deadline (4 h) are chosen; the 2.4T
# budget is fitted.  Parameters not listed keep the class defaults (crash_prob 0.01, the
# reward and token shape), which are illustrative: the paper gives no figure for them.
_PAPER_122B: dict[str, float] = {
    "harness_median_h": 1.444,
    "query_sigma": 0.3495,
    "exec_sigma": 0.351,
    "harness_deadline_h": 3.0,
    "overall_budget_h": 5.0,
    "eval_median_h": 0.2679,
    "eval_sigma": 0.25,
    "eval_failure_prob": 0.05237,
    "eval_failure_slope": 2.0,
    "tokens_median": 72230.0,
}
_PAPER_2P4T: dict[str, float] = {
    **_PAPER_122B,  # same tasks, same evaluator
    "harness_median_h": 2.2305,
    "harness_deadline_h": 4.0,
    "overall_budget_h": 4.51,
}


def paper_122b(seed: int = 0) -> ParametricWorkload:
    """Qwen 3.6 122B on NL2RepoBench, fitted to the paper's Figure 5.

    Targets (paper) vs this preset (64,000 queries x 16): mean execution 1.93 h (1.93),
    mean query 2.96 h (2.96; a query's duration is the max over its 16 executions),
    queries >= 4 h 9.51% (9.44%), harness timeouts 6.25% (6.32%) and overall timeouts
    0.87% (0.91%) of executions.

    Why a 3 h harness deadline and a 5 h overall budget: if the deadline plus an
    evaluation reached 4 h, every group containing a harness timeout would be a >= 4 h
    query, so 6.25% of executions would have to sit in <= 9.51% of groups (>= 10.5 of 16
    each) while the mean query / mean execution ratio (1.53) demands real spread within
    a group; the one-level lognormal difficulty cannot do both (fits with a 4-5 h
    deadline miss by >10 tolerances).  With a 3 h deadline a harness timeout ends after
    ~3.3 h (its evaluation included) and becomes a >= 4 h query only when its
    evaluation is retried: ~39% of groups hold a harness timeout, 9.5% are long.  Every
    overall timeout is a >= 4 h query (the budget exceeds 4 h), so 0.87% of executions
    must also be concentrated in few groups; that is why evaluator failures grow
    steeply with query difficulty (``eval_failure_slope`` 2: 5% per attempt on the
    median query, 29% at +1 sd, 75% at +2 sd, e.g. larger generated repositories).
    The budget leaves a 2 h evaluation window: an attempt takes ~16 min, so an
    overall timeout needs ~7 consecutive evaluator failures after a cut harness, which
    only the hardest queries produce.  Harness timeouts cluster at 3 h + evaluation.
    """
    return ParametricWorkload.paper_122b(seed)


def paper_2p4t(seed: int = 0) -> ParametricWorkload:
    """Qwen 3.8 2.4T on NL2RepoBench, fitted to the paper's Figure 8.

    Targets (paper) vs this preset (64,000 queries x 16): queries >= 4 h 61.1% (61.1%);
    among them, longest execution ending with an overall timeout 38.2% (37.0%).

    The model keeps the 122B tasks and evaluator (difficulty spreads and every
    evaluation parameter are copied) and changes only the policy's speed (median harness
    run 2.23 h instead of 1.44 h, fitted) and the limits.  The paper extended "the
    timeout limit" for this model: the harness deadline goes from 3 h to 4 h (chosen),
    so every cut execution is a >= 4 h query.  The overall budget is fitted: 4.51 h,
    i.e. a ~0.5 h evaluation window after the deadline.  With the 122B window of 2 h
    only ~7% of long queries would end with an overall timeout; 38.2% requires that the
    budget was extended much less than the deadline, so a cut execution whose
    evaluation needs a retry runs out of budget.  Long queries then concentrate between
    4 h and 4.51 h, near the limit, as the paper describes.  Derived (not targeted):
    harness timeouts 7.9%, overall timeouts 5.0% (12.9% together vs 7.2% for 122B, the
    "higher timeout rate"), mean execution 2.69 h, mean query 3.90 h.
    """
    return ParametricWorkload.paper_2p4t(seed)


# --------------------------------------------------------------------------------------


def _mix64(*values: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 finaliser, chained)."""
    state = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for value in values:
        state = (state ^ (value & mask)) * 0xBF58476D1CE4E5B9 & mask
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & mask
        state ^= state >> 31
    return state


@dataclass(kw_only=True, frozen=True)
class FixedWorkload:
    """Every execution takes exactly ``duration_s`` and completes with a valid reward.

    Used to check continuous dispatch against ``T_c = B * L / Q_c``.  ``reward`` set to
    a number gives every execution that reward; ``None`` (the default) gives a
    deterministic pseudo-random 0.0 or 1.0 (a hash of ``(seed, query_id, index)``, each
    with probability 1/2) so rewards still vary within a group and group-relative
    advantages are not all zero.  ``train_tokens`` is the same for every execution.
    """

    duration_s: float = 3600.0
    train_tokens: int = 100_000
    reward: float | None = None
    seed: int = 0
    name: str = "fixed"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s >= 0.0):
            raise ValueError(f"duration_s must be finite and >= 0, got {self.duration_s}")
        if self.train_tokens < 0:
            raise ValueError(f"train_tokens must be >= 0, got {self.train_tokens}")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite or None, got {self.reward}")

    def execution(self, query_id: int, index: int) -> ExecutionSpec:
        if self.reward is None:
            reward = float(_mix64(self.seed, query_id, index) >> 63)
        else:
            reward = self.reward
        return ExecutionSpec(
            query_id=query_id,
            index=index,
            duration_s=self.duration_s,
            outcome=Outcome.COMPLETED,
            reward=reward,
            train_tokens=self.train_tokens,
        )


# --------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class WorkloadStats:
    """Statistics of a workload over queries ``0 .. n_queries-1`` x ``n_per_query``.

    A query's duration is the maximum over its executions; a query is long when that is
    at least 4 h.  Rates are fractions of executions (outcomes are exclusive).
    ``frac_long_queries_ending_overall_timeout`` is, among long queries, the fraction
    whose longest execution ended with ``overall_timeout`` (NaN without long queries).
    ``mean_train_tokens`` averages over executions with a valid reward.
    """

    n_queries: int
    n_per_query: int
    mean_execution_h: float
    mean_query_h: float
    frac_queries_ge_4h: float
    harness_timeout_rate: float
    overall_timeout_rate: float
    failed_rate: float
    frac_long_queries_ending_overall_timeout: float
    mean_train_tokens: float
    mean_reward: float


def block_stats(block: SimulatedBlock) -> WorkloadStats:
    """:class:`WorkloadStats` of a block of (Q, n) executions."""
    duration_h = block.duration_h
    code = block.outcome_code
    n_queries, n_per_query = duration_h.shape
    query_h = duration_h.max(axis=1)
    long = query_h * SECONDS_PER_HOUR >= LONG_QUERY_S
    longest_is_overall = ((duration_h == query_h[:, None]) & (code == _OVERALL_TIMEOUT)).any(axis=1)
    valid = ~np.isnan(block.reward)
    return WorkloadStats(
        n_queries=n_queries,
        n_per_query=n_per_query,
        mean_execution_h=float(duration_h.mean()),
        mean_query_h=float(query_h.mean()),
        frac_queries_ge_4h=float(long.mean()),
        harness_timeout_rate=float((code == _HARNESS_TIMEOUT).mean()),
        overall_timeout_rate=float((code == _OVERALL_TIMEOUT).mean()),
        failed_rate=float((code == _FAILED).mean()),
        frac_long_queries_ending_overall_timeout=(
            float(longest_is_overall[long].mean()) if long.any() else math.nan
        ),
        mean_train_tokens=float(block.train_tokens[valid].mean()) if valid.any() else math.nan,
        mean_reward=float(block.reward[valid].mean()) if valid.any() else math.nan,
    )


def workload_stats(
    workload: Workload, n_queries: int, n_per_query: int = DEFAULT_GROUP_SIZE
) -> WorkloadStats:
    """Measure a workload over queries ``0 .. n_queries-1``, executions ``0 .. n-1`` each.

    A :class:`ParametricWorkload` is measured through its vectorised model on the very
    draws ``execution`` uses (same numbers, much faster); any other workload is asked
    execution by execution.
    """
    if n_queries < 1 or n_per_query < 1:
        raise ValueError("n_queries and n_per_query must be >= 1")
    if isinstance(workload, ParametricWorkload):
        return block_stats(
            workload.simulate(ParametricDraws.sample(workload.seed, n_queries, n_per_query))
        )
    duration_h = np.empty((n_queries, n_per_query))
    code = np.empty((n_queries, n_per_query), dtype=np.int8)
    reward = np.empty((n_queries, n_per_query))
    tokens = np.empty((n_queries, n_per_query), dtype=np.int64)
    for query_id in range(n_queries):
        for index in range(n_per_query):
            spec = workload.execution(query_id, index)
            duration_h[query_id, index] = spec.duration_s / SECONDS_PER_HOUR
            code[query_id, index] = _CODE_OUTCOMES.index(spec.outcome)
            reward[query_id, index] = math.nan if spec.reward is None else spec.reward
            tokens[query_id, index] = spec.train_tokens
    return block_stats(SimulatedBlock(duration_h, code, reward, tokens))


# --------------------------------------------------------------------------------------

#: Registry names accepted by :func:`workload_from_name`.
WORKLOAD_NAMES: tuple[str, ...] = ("paper-122b", "paper-2p4t", "fixed", "trace")


def workload_from_name(name: str, seed: int = 0, trace: Path | None = None) -> Workload:
    """Build a workload by registry name (see :data:`WORKLOAD_NAMES`).

    ``fixed`` runs every execution for 3600 s; ``trace`` replays the JSONL trace at
    ``trace`` (required for it; the other names ignore it, as the config allows a trace
    path to stay set while another workload is chosen).
    """
    if name not in WORKLOAD_NAMES:
        allowed = ", ".join(WORKLOAD_NAMES)
        raise ValueError(f"unknown workload {name!r}; allowed names: {allowed}")
    if name == "trace":
        if trace is None:
            raise ValueError("workload 'trace' requires a trace path")
        from qwengyre.sim.replay import TraceWorkload

        return TraceWorkload.from_path(trace)
    if name == "paper-122b":
        return paper_122b(seed)
    if name == "paper-2p4t":
        return paper_2p4t(seed)
    return FixedWorkload(duration_s=3600.0, seed=seed)
