"""A live run's costs from its metrics log (``qwengyre.sim.measured``), and ``qwengyre
plan --trace RUN_DIR`` simulating the run's executions at those costs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tests.traces import write_trace

from qwengyre.cli import main
from qwengyre.config import Config, config_to_yaml, load_config
from qwengyre.records.metrics import (
    METRICS_FILE,
    PublicationRecord,
    Record,
    RunMetrics,
    StepRecord,
    SwitchRecord,
)
from qwengyre.records.trace import TraceRecord
from qwengyre.sim.measured import measured_costs, with_costs
from qwengyre.sim.simulator import simulate
from qwengyre.sim.workload import workload_from_name
from qwengyre.types import Outcome


def step(step: int, tokens: int, micro_step_s: float, update_s: float) -> StepRecord:
    return StepRecord(
        time_s=10.0 * step,
        step=step,
        version=step + 1,
        reward_mean=0.5,
        reward_std=0.5,
        rewards=8,
        loss=0.1,
        clipped_fraction=0.0,
        grad_norm=1.0,
        tokens=tokens,
        micro_steps=2,
        cells=2,
        train_s=9.0,
        staleness_mean=1.0,
        micro_step_s=micro_step_s,
        update_s=update_s,
    )


RECORDS: list[Record] = [
    SwitchRecord(time_s=1.0, cell=1, to="training", seconds=2.0),
    SwitchRecord(time_s=2.0, cell=2, to="training", seconds=4.0),
    SwitchRecord(time_s=3.0, cell=1, to="rollout", seconds=1.0),
    PublicationRecord(4.0, 1, 0.5),
    PublicationRecord(5.0, 2, 1.5),
    step(0, 1000, 0.5, 0.2),
    step(1, 3000, 1.5, 0.4),
    step(2, 5000, math.nan, math.nan),  # written before the fields existed
]


def metrics(records: list[Record]) -> RunMetrics:
    log = RunMetrics()
    for r in records:
        log.add(r)
    return log


def test_each_cost_is_the_mean_of_its_records_and_a_step_without_times_is_skipped() -> None:
    config = load_config(None, ["trainer.micro_step_tokens=4096"])
    found, missing = measured_costs(metrics(RECORDS), config)
    assert {c.key: (c.value, c.samples) for c in found} == {
        "sim.micro_step_tokens": (4096, 0),
        "cells.rollout_to_training_s": (3.0, 2),
        "cells.training_to_rollout_s": (1.0, 1),
        "sim.publish_s": (1.0, 2),
        "sim.train_tokens_per_cell_s": (2000.0, 2),  # 4000 tokens in 2.0 s of micro-steps
        "sim.train_step_overhead_s": (pytest.approx(0.3), 2),
    }
    assert missing == []
    costs = with_costs(config, found).sim
    assert (costs.publish_s, costs.train_tokens_per_cell_s, costs.micro_step_tokens) == (
        1.0,
        2000.0,
        4096,
    )


def test_a_log_without_switches_or_step_times_keeps_the_configs_costs() -> None:
    config = Config()
    found, missing = measured_costs(metrics([RECORDS[3], RECORDS[-1]]), config)
    assert missing == [
        "cells.rollout_to_training_s",
        "cells.training_to_rollout_s",
        "sim.train_tokens_per_cell_s",
        "sim.train_step_overhead_s",
    ]
    kept = with_costs(config, found)
    assert kept.cells.rollout_to_training_s == config.cells.rollout_to_training_s
    assert kept.sim.train_tokens_per_cell_s == config.sim.train_tokens_per_cell_s
    assert kept.sim.publish_s == 0.5


def run_dir(tmp_path: Path) -> Path:
    """A run directory as ``qwengyre train`` leaves it: config, trace and metrics."""
    run = tmp_path / "run"
    run.mkdir()
    recorded = load_config(None, ["groups.size=4", "groups.batch=2", "cells.count=3"])
    (run / "config.yaml").write_text(config_to_yaml(recorded))
    traces = [
        TraceRecord(
            query=f"t{g}",
            group=g,
            index=i,
            start_s=0.0,
            end_s=5.0 + g + i,
            outcome=Outcome.COMPLETED,
            reward=float(i % 2),
            train_tokens=1000,
        )
        for g in range(3)
        for i in range(4)
    ]
    write_trace(run / "traces.jsonl", traces)
    (run / METRICS_FILE).write_text("".join(r.to_json() + "\n" for r in RECORDS))
    return run


def test_plan_on_a_run_directory_simulates_at_the_runs_costs_and_an_override_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_dir(tmp_path)
    out, js = tmp_path / "plan.yaml", tmp_path / "plan.json"
    args = ["plan", "--trace", str(run), "--target-staleness", "0.5", "sim.publish_s=7"]
    assert main([*args, "sim.steps=4", "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert f"costs from {run / METRICS_FILE}:" in printed
    assert (
        "sim.train_tokens_per_cell_s = 2000 (tokens over micro-step seconds in 2 steps)" in printed
    )
    assert "sim.publish_s: as given" in printed
    planned = load_config(out)
    assert planned.sim.publish_s == 7.0  # the override, not the log's 1.0
    assert planned.sim.train_tokens_per_cell_s == 2000.0
    assert planned.cells.rollout_to_training_s == 3.0
    assert planned.sim.train_step_overhead_s == pytest.approx(0.3)
    # The plan's time is the simulator's at these costs, not at the defaults.
    predicted = json.loads(js.read_text())["recommended"]["end_to_end_s"]
    workload = workload_from_name("trace", 0, planned.sim.trace)
    assert simulate(planned, workload).end_to_end_s == pytest.approx(predicted)
    defaults = planned.model_copy(update={"sim": Config().sim.model_copy(update={"steps": 4})})
    assert simulate(defaults, workload).end_to_end_s > 1.5 * predicted
