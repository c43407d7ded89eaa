"""``qwengyre plan``: every shape at a target staleness simulated and ranked, the fastest
written as a config that loads and simulates to the time the plan predicted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.traces import write_trace

from qwengyre.cli import main
from qwengyre.config import Config, config_to_yaml, load_config
from qwengyre.records.trace import TraceRecord
from qwengyre.sim.plan import best_times, plan_run, plan_workloads, sweep
from qwengyre.sim.simulator import simulate
from qwengyre.sim.workload import workload_from_name
from qwengyre.types import Outcome

SMALL = ["groups.batch=4", "cells.count=4", "cells.capacity=32", "sim.steps=4"]


def record(query: str, group: int, index: int, seconds: float) -> TraceRecord:
    return TraceRecord(
        query=query,
        group=group,
        index=index,
        start_s=0.0,
        end_s=seconds,
        outcome=Outcome.COMPLETED,
        reward=float(index % 2),
        train_tokens=1000,
    )


def small(*extra: str) -> Config:
    return load_config(None, [*SMALL, *extra])


def test_candidates_are_ranked_by_the_time_they_really_take() -> None:
    config = small("sim.steps=8")  # two whole bursts after the initial dispatch: E[d]
    workloads = plan_workloads(config, 1)
    plan = plan_run(config, workloads, 1.0, ["elastic", "async"])
    assert {c.shape.policy for c in plan.candidates} == {"elastic", "async"}
    times = [c.mean_s for c in plan.candidates]
    assert times == sorted(times) and times[0] < times[-1]
    best, runner_up = plan.candidates[:2]
    for candidate in (best, runner_up):
        again = simulate(candidate.shape.apply(config), workloads[0])
        assert again.end_to_end_s == candidate.mean_s
    assert best.step_s == best.mean_s / 8
    assert 0 < best.utilisation <= 1 and best.over_bound >= 1
    assert best.staleness == pytest.approx(1.0, abs=0.25)


def test_several_seeds_are_averaged_and_the_yaml_simulates_to_each_seeds_time(
    tmp_path: Path,
) -> None:
    config = small("seed=5")
    plan = plan_run(config, plan_workloads(config, 2), 1.0, ["colocate", "elastic"])
    best = plan.best
    assert len(best.times_s) == 2 and best.times_s[0] != best.times_s[1]
    assert best.mean_s == pytest.approx(sum(best.times_s) / 2)
    path = tmp_path / "plan.yaml"
    path.write_text(plan.recommended_yaml())
    loaded = load_config(path)
    recommended = plan.recommended_config()
    assert loaded.scheduler == recommended.scheduler and loaded.cells == recommended.cells
    assert (loaded.scheduler.mu, loaded.scheduler.phi) == (best.shape.mu, best.shape.phi)
    for i, expected in enumerate(best.times_s):
        workload = workload_from_name("paper-122b", 5 + i)
        assert simulate(loaded, workload).end_to_end_s == expected


@pytest.mark.parametrize(
    ("policies", "target", "seeds", "message"),
    [
        (["elastic", "eager"], 1.0, 1, "unknown policy 'eager'; allowed: elastic, async"),
        ([], 1.0, 1, "no policy to plan"),
        (["elastic"], -0.5, 1, "target staleness must be a number >= 0, got -0.5"),
        (["elastic"], 1.0, 0, "no workload to plan on"),
    ],
)
def test_bad_input_is_refused_naming_it(
    policies: list[str], target: float, seeds: int, message: str
) -> None:
    config = small()
    workloads = plan_workloads(config, seeds) if seeds else []
    with pytest.raises(ValueError, match=message):
        plan_run(config, workloads, target, policies)


def test_a_trace_is_replayed_at_one_seed_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [record("q", 0, i, 60.0 * (i + 1)) for i in range(4)])
    config = small(f"sim.trace={trace}", "sim.workload=trace")
    with pytest.raises(ValueError, match="a trace replays the same executions"):
        plan_workloads(config, 2)
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        plan_workloads(config, 0)


def test_a_sweep_gives_each_policys_best_time_per_target() -> None:
    config = small()
    workloads = plan_workloads(config, 1)
    at_one = plan_run(config, workloads, 1.0, ["elastic", "async"])
    plans = sweep(config, workloads, [1.5, 0.5, 1.0], ["elastic", "async"], plans=[at_one])
    assert [p.target for p in plans] == [0.5, 1.0, 1.5] and plans[1] is at_one
    points = best_times(plans)
    assert set(points) == {"elastic", "async"}
    for policy, series in points.items():
        assert [t for t, _, _ in series] == [0.5, 1.0, 1.5]
        for plan, (_, seconds, shape) in zip(plans, series, strict=True):
            fastest = min(c.mean_s for c in plan.candidates if c.shape.policy == policy)
            assert seconds == fastest and shape


def test_cli_plans_a_preset_and_writes_yaml_json_and_the_staleness_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, report, plots = tmp_path / "rec.yaml", tmp_path / "plan.json", tmp_path / "plots"
    args = ["plan", "--preset", "paper-122b", *SMALL, "--target-staleness", "1"]
    args += ["--policies", "elastic,colocate", "--seeds", "2", "--top", "1"]
    assert main([*args, "--out", str(out), "--json", str(report), "--plot", str(plots)]) == 0
    printed = capsys.readouterr().out
    assert "mean of 2 seeds" in printed and "recommended: " in printed
    table = printed[: printed.index("recommended: ")]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert len(rows) == 2  # the fastest, and the fastest of the other policy
    assert {row.split("│")[2].strip() for row in rows} == {"elastic", "colocate"}
    assert f"wrote {out}" in printed
    plan = json.loads(report.read_text())
    assert plan["recommended"] == plan["candidates"][0]
    assert {c["policy"] for c in plan["candidates"]} == {"elastic", "colocate"}
    assert plan["seeds"] == 2 and len(plan["recommended"]["end_to_end_s_per_workload"]) == 2
    assert [p["target_staleness"] for p in plan["sweep"]["elastic"]] == [0.5, 1.0, 1.5, 2.0]
    assert (plots / "staleness_sweep.png").read_bytes()[:4] == b"\x89PNG"
    loaded = load_config(out)
    assert loaded.scheduler.policy == plan["recommended"]["policy"]
    assert loaded.groups.batch == 4 and loaded.sim.steps == 4


def test_cli_plans_a_run_directory_with_the_runs_own_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded = small("groups.size=4", "groups.batch=2", "cells.count=3", "scheduler.policy=async")
    (run_dir / "config.yaml").write_text(config_to_yaml(recorded))
    records = [record(f"t{g}", g, i, 5.0 + g + i) for g in range(3) for i in range(4)]
    write_trace(run_dir / "traces.jsonl", records)
    assert main(["plan", "--trace", str(run_dir), "--target-staleness", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert f"config: {run_dir / 'config.yaml'}" in printed
    shown = yaml.safe_load(printed[printed.index("seed:") :])
    assert (shown["groups"]["size"], shown["groups"]["batch"]) == (4, 2)
    assert shown["sim"]["workload"] == "trace"
    assert shown["sim"]["trace"] == str(run_dir / "traces.jsonl")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim.steps=2", "--target-staleness", "1"], "plan needs a workload"),
        (["--preset", "paper-122b", "--top", "0", "--target-staleness", "1"], "--top must be"),
        (["--preset", "paper-122b", "--target-staleness", "1", "--policies", "x"], "policy 'x'"),
        (["--preset", "paper-122b"], "plan needs --target-staleness"),
        (["--trace", "nowhere.jsonl", "--target-staleness", "1"], "no trace at nowhere.jsonl"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
