"""Every scheduling setting the config accepts runs live.

The matrix is every policy x dispatch x streaming x standalone-pool combination of the
typed config; each one it refuses is refused with an error naming the keys. Of the
accepted ones, a covering set trains two steps live with real cell processes, the proxy
and the toy harness: every pair of settings (policy with dispatch, dispatch with
streaming, ...) appears in at least one live run (:func:`all_pairs`: 7 runs for 20
modes; the scheduler's handling of each whole mode is checked by the simulator's
property tests, which drive the same scheduler). A new policy or dispatch value joins
the matrix by itself, so a setting the config accepts and the runtime cannot run cannot
ship.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from typing import get_args

import pytest
from tests.test_runtime_train import run, served_calls

from qwengyre.config import ConfigError, Dispatch, Policy, load_config
from qwengyre.presets import preset_path
from qwengyre.records.assessments import read_assessments
from qwengyre.records.metrics import read_metrics
from qwengyre.report.html import steady_staleness
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger

pytestmark = pytest.mark.slow

STANDALONE = 2  # C_s of the pool when the mode has one
MODES = list(
    itertools.product(get_args(Policy), get_args(Dispatch), (True, False), (0, STANDALONE))
)


def mode_overrides(policy: str, dispatch: str, streaming: bool, standalone: int) -> list[str]:
    # Colocate with a standalone pool dispatches extra groups, which run on that pool
    # while the whole colocated pool trains (the paper's C1-C2).
    phi = 1 if policy == "colocate" and standalone else 0
    return [
        "run.steps=2",
        "cells.count=2",
        "cells.capacity=8",
        "groups.size=4",  # continuous elastic: (phi + mu) B N = 8 fit in cell 1 (Eq 5)
        "groups.batch=2",
        "groups.min_valid=2",
        "scheduler.target_staleness=null",
        "scheduler.mu=1",
        f"scheduler.phi={phi}",
        f"scheduler.policy={policy}",
        f"scheduler.dispatch={dispatch}",
        f"scheduler.streaming={str(streaming).lower()}",
        f"cells.standalone_capacity={standalone}",
    ]


def refusal(mode: tuple[str, str, bool, int]) -> str | None:
    """Why the config refuses ``mode``, or None when it accepts it."""
    try:
        load_config(preset_path("embedded"), mode_overrides(*mode)).scheduler_params()
    except (ConfigError, ValueError) as error:
        return str(error)
    return None


REFUSED = {mode: why for mode in MODES if (why := refusal(mode)) is not None}
ACCEPTED = [mode for mode in MODES if mode not in REFUSED]


def all_pairs(modes: list[tuple[str, str, bool, int]]) -> list[tuple[str, str, bool, int]]:
    """A few of ``modes`` in which every pair of settings that any mode combines appears
    (greedy: each pick covers the most pairs still missing)."""

    def pairs(mode: tuple[str, str, bool, int]) -> set[tuple[int, int, object, object]]:
        return {(i, j, mode[i], mode[j]) for i, j in itertools.combinations(range(4), 2)}

    missing = set().union(*(pairs(m) for m in modes))
    chosen = []
    while missing:
        best = max(modes, key=lambda m: len(pairs(m) & missing))
        chosen.append(best)
        missing -= pairs(best)
    return chosen


LIVE = all_pairs(ACCEPTED)


def test_the_config_refuses_only_modes_that_cannot_train() -> None:
    # Colocate switches the whole pool once rollout is over: continuous dispatch never
    # lets rollout end. Everything else runs (the test below).
    assert set(REFUSED) == {m for m in MODES if m[0] == "colocate" and m[1] == "continuous"}
    assert all("dispatch" in why and "colocate" in why for why in REFUSED.values())


def mode_id(mode: tuple[str, str, bool, int]) -> str:
    policy, dispatch, streaming, standalone = mode
    return f"{policy}-{dispatch}-{'streaming' if streaming else 'whole'}-standalone{standalone}"


def test_the_live_runs_cover_every_pair_of_settings() -> None:
    for i, j in itertools.combinations(range(4), 2):
        assert {(m[i], m[j]) for m in LIVE} == {(m[i], m[j]) for m in ACCEPTED}
    assert len(LIVE) < len(ACCEPTED) and set(LIVE) <= set(ACCEPTED)


@pytest.mark.parametrize("mode", LIVE, ids=[mode_id(m) for m in LIVE])
def test_every_accepted_setting_trains_live(
    tiny_model_dir: Path, tmp_path: Path, mode: tuple[str, str, bool, int]
) -> None:
    policy, dispatch, streaming, standalone = mode
    run_dir = run(tmp_path, tiny_model_dir, *mode_overrides(*mode))
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    trained = [g.group_id for g in metrics.groups]
    assert len(trained) == 2 * 2 and len(set(trained)) == 4  # B groups a step, once each
    assert set(trained) <= {g.group_id for g in Ledger(run_dir / LEDGER_DIR).groups()}
    run_record = metrics.run
    assert run_record is not None  # the report describes the mode from it
    assert (run_record.policy, run_record.dispatch, run_record.streaming) == (
        policy,
        dispatch,
        streaming,
    )
    assert run_record.standalone_capacity == standalone
    engines = Counter(engine for engine, _ in served_calls(run_dir))
    assert (engines["standalone"] > 0) == (standalone > 0), engines
    moved = {r.cell for r in metrics.roles if r.role == "to_training"}
    if policy == "async":
        assert not moved  # the split is fixed
    else:
        assert 0 in moved  # the core trained, after a move


def test_a_satellite_joins_a_batch_that_is_already_training(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # One cell serves every execution (C_e = 16 = B N), so Eq 5 lets satellite 1 join
    # as soon as a ready group is there (rho_min B = 1 group); the batch stays open
    # until its fourth group is ready, long after the core started training it.
    run_dir = run(
        tmp_path,
        tiny_model_dir,
        "run.steps=2",
        "cells.count=3",
        "cells.capacity=16",
        "groups.size=4",
        "groups.batch=4",
        "groups.min_valid=2",
        "scheduler.target_staleness=null",
        "scheduler.mu=1",
        "scheduler.phi=0",
        "scheduler.rho_min=0.25",
        "scheduler.tau_s=0",
    )
    metrics = read_metrics(run_dir)
    joined = [r.time_s for r in metrics.roles if r.cell == 1 and r.role == "training"]
    mid_batch = [
        step
        for step in metrics.steps
        if step.cells >= 2 and any(step.time_s - step.train_s < t < step.time_s for t in joined)
    ]
    assert mid_batch, (joined, [(s.time_s - s.train_s, s.time_s, s.cells) for s in metrics.steps])
    assert all(s.cells in (1, 2, 3) for s in metrics.steps)


FLAKY_EVALUATOR = (
    "import json, random; r = random.random();"
    " print(json.dumps({'score': float(r < 0.5), 'valid': random.random() >= 0.15}))"
)


def flaky_tasks(path: Path) -> Path:
    """Coin-flip rewards, and 15% of evaluations invalid (no reward, never a zero)."""
    evaluator = CommandEvaluator(command=[sys.executable, "-c", FLAKY_EVALUATOR], timeout_s=30)
    tasks = [Task(id=f"t{i}", instructions=f"Say {i}.", evaluator=evaluator) for i in range(6)]
    dump_tasks(path, tasks)
    return path


def test_staleness_matches_eq2_live_with_invalid_rewards(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Groups need all N = 4 valid rewards (one surplus execution, top-ups from a reserve),
    # so invalid evaluations make groups short, topped up and late: Eq 2 must still hold
    # and the waterlevel w = d - f must not rise within a burst.
    run_dir = run(
        tmp_path,
        tiny_model_dir,
        f"harness.tasks={flaky_tasks(tmp_path / 'flaky.jsonl')}",
        "run.steps=12",
        "cells.count=3",
        "cells.capacity=24",
        "groups.size=4",
        "groups.oversample=1",
        "groups.min_valid=null",
        "groups.reserve=4",
        "groups.batch=2",
        "evaluation.max_attempts=1",  # an invalid evaluation stays invalid
        "scheduler.target_staleness=null",
        "scheduler.mu=2",
        "scheduler.phi=0.5",
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == list(range(1, 13))
    invalid = [r for r in read_assessments(run_dir / "assessments.jsonl") if not r.assessment.valid]
    assert invalid  # the injected failures happened
    assert abs(steady_staleness(metrics) - 1.0) <= 0.1  # Eq 2: phi + (mu - 1) / 2
    # w only rises with a burst's dispatch, right after a publication: at most once per
    # publication (and once at the start). The one exception is a stalled burst (more
    # short groups than phi B extra ones cover), which dispatches its owed top-ups at once
    # and says so in the load record (CI saw one).
    boundaries = [0.0, *(p.time_s for p in metrics.publications)]
    rises = [
        b.time_s
        for a, b in itertools.pairwise(metrics.loads)
        if b.waterlevel > a.waterlevel and b.stalls == a.stalls
    ]
    burst_of = [max(i for i, t in enumerate(boundaries) if t <= rise) for rise in rises]
    assert len(burst_of) == len(set(burst_of)), (rises, boundaries)
