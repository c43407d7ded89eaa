"""The metrics log (write, read back, crash tolerance) and the HTML run report."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qwengyre.cli import main
from qwengyre.config import load_config
from qwengyre.records.assessments import ASSESSMENTS_FILE, Assessment, AssessmentLog
from qwengyre.records.metrics import (
    GroupRecord,
    LoadRecord,
    MetricsError,
    MetricsWriter,
    PublicationRecord,
    Record,
    RoleRecord,
    RunMetrics,
    RunRecord,
    StepRecord,
    SwitchRecord,
    UsageRecord,
    parse_record,
    read_metrics,
)
from qwengyre.report import sinks as sinks_module
from qwengyre.report.html import role_spans, summarize, training_fractions, write_report
from qwengyre.report.sinks import open_metrics
from qwengyre.rollout.evaluation import placeholder
from qwengyre.scheduler.events import Role
from qwengyre.sim.simulator import RoleSpan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 10
STALENESS = [0, 1, 1, 2, 2, 2, 3, 1]  # planted: mean 1.5


def _step(step: int, time_s: float) -> StepRecord:
    return StepRecord(
        time_s=time_s,
        step=step,
        version=step + 1,
        reward_mean=0.1 * step,
        reward_std=0.05,
        rewards=16,
        loss=1.0 / (step + 1),
        clipped_fraction=0.01,
        grad_norm=0.5,
        tokens=4096,
        micro_steps=4,
        cells=2,
        train_s=30.0,
        staleness_mean=1.5,
        ratio_mean=1.0,
        kl=0.001 * step,
        routing_drift=0.02 * step,
        micro_step_s=25.0,
        update_s=2.0,
    )


def _records() -> list[Record]:
    """A 3-cell elastic run of 10 steps, 100 s each (1000 s in all)."""
    records: list[Record] = [
        RunRecord(
            time_s=0.0,
            policy="elastic",
            mu=3,
            phi=0.5,
            cells=3,
            predicted_staleness=1.5,
            group_size=8,
            batch=4,
            engine_backend="vllm",
        )
    ]
    records += [RoleRecord(0.0, cell, Role.ROLLOUT.value) for cell in range(3)]
    records += [RoleRecord(0.0, 0, Role.TRAINING.value)]  # the core trains from the start
    # Cell 1 goes to training at 100 s (5 s switch) and back at 400 s (3 s switch).
    records += [
        RoleRecord(100.0, 1, Role.TO_TRAINING.value),
        SwitchRecord(time_s=105.0, cell=1, to="training", seconds=5.0, engine="stopped"),
        RoleRecord(105.0, 1, Role.TRAINING.value),
        RoleRecord(400.0, 1, Role.TO_ROLLOUT.value),
        SwitchRecord(time_s=403.0, cell=1, to="rollout", seconds=3.0, engine="stopped"),
        RoleRecord(403.0, 1, Role.ROLLOUT.value),
        # Cell 2 switches to training at 500 s (7 s) and stays there to the end.
        RoleRecord(500.0, 2, Role.TO_TRAINING.value),
        SwitchRecord(time_s=507.0, cell=2, to="training", seconds=7.0),
        RoleRecord(507.0, 2, Role.TRAINING.value),
    ]
    records += [
        LoadRecord(time_s=50.0 * i, running=10 - i % 3, queued=i % 4, capacity=12)
        for i in range(20)
    ]
    records += [_step(s, 100.0 * (s + 1)) for s in range(STEPS)]
    records += [PublicationRecord(100.0 * s + 50.0, s, 0.5 * s) for s in (1, 2, 3)]
    records += [
        GroupRecord(
            time_s=100.0 * (3 + g),
            group_id=g,
            dispatch_version=3 + g - d,
            step=3 + g,
            staleness=d,
            execution_staleness=d - 0.25,
        )
        for g, d in enumerate(STALENESS)
    ]
    return records


def _write_run(run_dir: Path, records: list[Record] | None = None) -> Path:
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for record in records if records is not None else _records():
            writer.write(record)
    return run_dir / "metrics.jsonl"


# ---------------------------------------------------------------- records and the log


def test_records_round_trip_through_json():
    for record in _records():
        line = record.to_json()
        assert json.loads(line)["kind"] == record.KIND
        assert parse_record(line) == record
        assert type(record).from_json(line) == record


def test_the_log_reads_back_equal(tmp_path: Path):
    records = _records()
    path = _write_run(tmp_path, records)
    metrics = read_metrics(path)
    expected = RunMetrics()
    for record in records:
        expected.add(record)
    assert metrics == expected
    assert len(metrics) == len(records)
    assert metrics.run is not None and metrics.run.cells == 3
    assert len(metrics.steps) == STEPS and len(metrics.switches) == 3
    assert metrics.end_s == 1000.0
    assert read_metrics(tmp_path) == metrics  # a run directory works too
    # One line per record, every line complete.
    assert path.read_text().count("\n") == len(records)


def test_the_writer_appends(tmp_path: Path):
    path = _write_run(tmp_path, _records()[:3])
    _write_run(tmp_path, _records()[3:])
    assert len(read_metrics(path)) == len(_records())


def test_a_truncated_last_line_is_ignored(tmp_path: Path):
    path = _write_run(tmp_path)
    full = read_metrics(path)
    partial = _step(STEPS, 1100.0).to_json()[:40]  # the crash hit mid-write
    with path.open("a") as f:
        f.write(partial)
    assert read_metrics(path) == full


def test_a_malformed_line_names_its_number(tmp_path: Path):
    path = _write_run(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = '{"kind": "step", "time_s": 1.0\n'  # broken JSON on line 5
    path.write_text("".join(lines))
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:5: invalid JSON"):
        read_metrics(path)
    # A complete (newline-terminated) last line that is bad is an error too.
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = _records()[4].to_json() + "\n"
    lines[-1] = '{"kind": "nope"}\n'
    path.write_text("".join(lines))
    with pytest.raises(MetricsError, match=rf":{len(lines)}: unknown kind 'nope'"):
        read_metrics(path)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"kind": "role", "time_s": 1, "cell": 0, "role": "resting"}', "field 'role'"),
        ('{"kind": "switch", "time_s": 1, "cell": 0, "to": "up", "seconds": 1}', "field 'to'"),
        ('{"kind": "load", "time_s": 1, "running": 1.5, "queued": 0, "capacity": 2}', "'running'"),
        ('{"kind": "load", "time_s": 1, "running": 1}', "missing field(s) 'queued', 'capacity'"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_records_say_what_is_wrong(line: str, fragment: str):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_record(line)


def test_integers_are_accepted_for_float_fields_and_extra_keys_ignored():
    record = parse_record(
        '{"kind": "switch", "time_s": 2, "cell": 1, "to": "rollout", "seconds": 3, "x": 0}'
    )
    assert record == SwitchRecord(time_s=2.0, cell=1, to="rollout", seconds=3.0)
    assert isinstance(record.time_s, float)


class _FakeSummaryWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int, walltime: float | None = None
    ) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_step_metrics_are_mirrored_to_tensorboard_when_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    fake = _FakeSummaryWriter()
    dirs: list[Path] = []

    def open_fake(log_dir: Path, purge_step: int | None = None) -> Any:
        dirs.append(log_dir)
        return fake

    monkeypatch.setattr(sinks_module, "open_tensorboard", open_fake)
    with open_metrics(tmp_path, load_config(None, []), fsync=True) as writer:
        assert [sink.name for sink in writer.sinks] == ["tensorboard"]
        writer.write(_step(7, 10.0))
        writer.write(LoadRecord(time_s=1.0, running=1, queued=2, capacity=3))  # at the latest step
    assert dirs == [tmp_path / "tensorboard"]
    assert fake.closed and writer.closed
    tags = {tag: (value, step) for tag, value, step in fake.scalars}
    assert tags["step/reward_mean"] == (pytest.approx(0.7), 7)
    assert tags["step/tokens"] == (4096.0, 7)
    assert "step/step" not in tags
    assert {t for t in tags if t.startswith("step/")} == {
        f"step/{f.name}" for f in dataclasses.fields(StepRecord) if f.name != "step"
    }
    assert tags["load/queued"] == (2.0, 7)  # tests/test_metric_sinks.py: the other scalars


def test_a_closed_metrics_log_refuses_records(tmp_path: Path):
    with MetricsWriter(tmp_path / "m.jsonl") as writer:
        writer.write(_step(0, 1.0))
    assert read_metrics(tmp_path / "m.jsonl").steps[0].step == 0
    with pytest.raises(ValueError, match="closed"):
        writer.write(_step(1, 2.0))


# ---------------------------------------------------------------- spans and the summary


def test_role_spans_last_until_the_next_record_and_close_at_the_end():
    roles = [
        RoleRecord(0.0, 1, "rollout"),
        RoleRecord(0.0, 0, "rollout"),
        RoleRecord(0.0, 0, "training"),  # same time: replaces the zero-length rollout span
        RoleRecord(100.0, 1, "to_training"),
        RoleRecord(50.0, 1, "rollout"),  # repeated role, out of order: the span goes on
        RoleRecord(105.0, 1, "training"),
    ]
    assert role_spans(roles, end_s=200.0) == [
        RoleSpan(0, Role.TRAINING, 0.0, 200.0),
        RoleSpan(1, Role.ROLLOUT, 0.0, 100.0),
        RoleSpan(1, Role.TO_TRAINING, 100.0, 105.0),
        RoleSpan(1, Role.TRAINING, 105.0, 200.0),
    ]
    assert role_spans([], 10.0) == []
    # A role entered at the very end leaves no span.
    assert role_spans([RoleRecord(10.0, 0, "training")], 10.0) == []


def test_training_fractions():
    spans = role_spans([r for r in _records() if isinstance(r, RoleRecord)], end_s=1000.0)
    fractions = training_fractions(spans, 3, 1000.0)
    assert fractions == pytest.approx([1.0, (400 - 105) / 1000, (1000 - 507) / 1000])


def test_summary_numbers(tmp_path: Path):
    summary = summarize(read_metrics(_write_run(tmp_path)))
    assert summary.steps == STEPS and summary.wall_s == 1000.0
    assert summary.seconds_per_step == 100.0
    assert summary.reward_first_fifth == pytest.approx(statistics.fmean([0.0, 0.1]))
    assert summary.reward_last_fifth == pytest.approx(statistics.fmean([0.8, 0.9]))
    assert summary.mean_staleness == pytest.approx(1.5)
    assert summary.predicted_staleness == 1.5
    assert summary.mean_switch_s == {"training": 6.0, "rollout": 3.0}
    assert summary.switches == {"training": 2, "rollout": 1}
    assert summary.training_fraction == pytest.approx([1.0, 0.295, 0.493])
    assert summary.steps_by_cells == {2: STEPS}


# ---------------------------------------------------------------- the report


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_write_report_writes_a_page_and_valid_pngs(tmp_path: Path):
    _write_run(tmp_path)
    log = AssessmentLog(tmp_path / ASSESSMENTS_FILE)
    invalid = Assessment(
        score=None, valid=False, artifact="d1", attempt=1, evaluator="command", detail="timeout"
    )
    log.write(
        "a",
        0,
        0,
        [
            invalid,
            Assessment(
                score=1.0, valid=True, artifact="d1", attempt=2, evaluator="command", detail="ok"
            ),
        ],
    )
    log.write("b", 0, 1, [invalid])
    log.write("c", 0, 2, [placeholder("the harness could not start")])
    index = write_report(tmp_path)
    assert index == tmp_path / "report" / "index.html"
    page = index.read_text()
    images = re.findall(r"<img src='([^']+)'", page)
    assert sorted(images) == sorted(
        ["reward.png", "training.png", "timeline.png", "load.png", "staleness.png", "switches.png"]
    )
    for name in images:
        assert _is_png(index.parent / name), name
    assert "none recorded" not in page.lower() and "No " not in page
    table = page[page.index("<table") : page.index("</table>")]
    for fragment in [
        "<th>steps</th><td class='num'>10</td>",
        "<th>mean staleness (measured)</th><td class='num'>1.500</td>",
        "<th>mean staleness (Eq 2 prediction)</th><td class='num'>1.500</td>",
        # The whole bursts after the initial dispatch (steps 6-8, steady_steps): 2, 2, 2.
        "<th>mean staleness, steady state (measured)</th><td class='num'>2.000</td>",
        "executions launched with</th><td class='num'>1.250</td>",
        "<th>mean reward, first fifth of steps</th><td class='num'>0.050</td>",
        "<th>mean reward, last fifth of steps</th><td class='num'>0.850</td>",
        # cell 2's switch was logged before the engine's way was recorded
        "mean switch time to training</th><td class='num'>6.00 s (2 switches; engine "
        "memory stopped)",
        "mean switch time to rollout</th><td class='num'>3.00 s (1 switches; engine "
        "memory stopped)",
        "mean publication time (vllm engines)</th><td class='num'>1.00 s (3 publications)",
        "cell 0 (core): time in training</th><td class='num'>100.0%",
        "cell 1: time in training</th><td class='num'>29.5%",
        "cell 2: time in training</th><td class='num'>49.3%",
        "cells training a step</th><td class='num'>2: 10 steps",
        "1000.0 s",
    ]:
        assert fragment in table, fragment
    assessments = page[page.index("<h2>Assessments</h2>") :]
    for fragment in [
        "executions with an assessment</th><td class='num'>3",
        "evaluated: a valid reward</th><td class='num'>1 of 2",
        "evaluated: no valid reward (not trained)</th><td class='num'>1",
        "evaluation attempts (retried executions)</th><td class='num'>3 (1)",
        "infrastructure failures (zero-reward placeholder)</th><td class='num'>1",
    ]:
        assert fragment in assessments, fragment


def test_the_training_figure_has_a_panel_per_quantity_from_the_steps_that_trained():
    from qwengyre.report.html import TRAINING_PANELS, training_figure

    steps = [r for r in _records() if isinstance(r, StepRecord)]
    fig = training_figure(steps)
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == [label for _, label in TRAINING_PANELS]
    trained = [s for s in steps if s.learning_signal]
    loss_x, loss_y = axes[0].get_lines()[0].get_data()
    assert list(loss_x) == [s.step for s in trained] and list(loss_y) == [s.loss for s in trained]
    _, per_execution = axes[3].get_lines()[0].get_data()
    assert list(per_execution) == [s.tokens / s.rewards for s in trained]


def test_missing_kinds_get_a_note_not_a_failure(tmp_path: Path):
    # An async run: no switches, no role changes beyond the start; and no groups logged.
    records = [r for r in _records() if not isinstance(r, SwitchRecord | GroupRecord | RoleRecord)]
    _write_run(tmp_path, records)
    out = tmp_path / "elsewhere"
    index = write_report(tmp_path, out)
    assert index == out / "index.html"
    page = index.read_text()
    assert "No switches recorded" in page and "No trained groups recorded" in page
    assert "No role changes recorded" in page
    assert sorted(p.name for p in out.glob("*.png")) == ["load.png", "reward.png", "training.png"]
    # An empty log still gives a page.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert "No steps recorded" in write_report(tmp_path / "empty").read_text()
    assert math.isnan(summarize(RunMetrics()).mean_staleness)


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    _write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "report" / "index.html") and Path(out).is_file()
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r2")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r2" / "index.html")


def test_report_command_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    for run_dir, fragment in [
        (tmp_path / "nope", "no run directory"),
        (tmp_path, "no metrics.jsonl in"),
    ]:
        assert main(["report", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qwengyre: error: ") and fragment in err
        assert err.count("\n") == 1 and "Traceback" not in err
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step"}\n{}\n')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:1: missing field(s)" in err and err.count("\n") == 1


def _async_records() -> list[Record]:
    """An async run of 10 steps, 150 s each: cell 0 trains, cells 1 and 2 roll out."""
    return [
        RunRecord(
            time_s=0.0,
            policy="async",
            mu=1,
            phi=1.0,
            cells=3,
            predicted_staleness=2.0,
            group_size=8,
            batch=4,
        ),
        *(RoleRecord(0.0, cell, Role.ROLLOUT.value) for cell in range(3)),
        RoleRecord(0.0, 0, Role.TRAINING.value),
        *(_step(s, 150.0 * (s + 1)) for s in range(STEPS)),
        UsageRecord(1500.0, 0, busy_s=1350.0, idle_s=150.0),
        UsageRecord(1500.0, 1, busy_s=750.0, idle_s=750.0),
        UsageRecord(1500.0, 2, busy_s=600.0, idle_s=900.0),
    ]


def test_several_runs_are_reported_and_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elastic, slower = tmp_path / "elastic-run", tmp_path / "async-run"
    _write_run(elastic)
    _write_run(slower, _async_records())
    assert main(["report", str(elastic), str(slower)]) == 0
    out = capsys.readouterr().out
    assert (elastic / "report" / "index.html").is_file()
    assert (slower / "report" / "index.html").is_file()
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    cells = [c.strip() for c in rows["async-run"].split("│")[1:-1]]
    # run, policy, steps, s/step, vs elastic, idle per cell, mean idle, staleness,
    # steps by cells, reward: 150 s per step against elastic's 100 s.
    assert cells[:5] == ["async-run", "async (μ=1, φ=1)", "10", "150.0", "1.50x"]
    assert cells[5:9] == ["10% / 50% / 60%", "40%", "– (2.00)", "2:10"]  # no group records
    assert cells[9] == "0.050 → 0.850"
    assert [c.strip() for c in rows["elastic-run"].split("│")[2:6]] == [
        "elastic (μ=3, φ=0.5)",
        "10",
        "100.0",
        "",
    ]
    # The same steps, cells and groups; the fixtures' engines differ, and it says so.
    assert [line for line in out.splitlines() if line.startswith("caveat")] == [
        "caveat: engine.backend differs (elastic-run: vllm, async-run: embedded): not the"
        " same workload"
    ]


def test_a_comparison_says_what_differs_besides_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elastic, shorter = tmp_path / "elastic-run", tmp_path / "short-async"
    _write_run(elastic)
    records = _async_records()
    run = next(r for r in records if isinstance(r, RunRecord))
    shorter_records = [
        replace(r, batch=8) if r is run else r
        for r in records
        if not (isinstance(r, StepRecord) and r.step >= 4)
    ]
    _write_run(shorter, shorter_records)
    assert main(["report", str(elastic), str(shorter)]) == 0
    caveats = [line for line in capsys.readouterr().out.splitlines() if line.startswith("caveat")]
    assert caveats == [
        "caveat: the runs trained different numbers of steps (elastic-run: 10, short-async: 4):"
        " times per step and reward fifths cover different stretches of training",
        "caveat: groups.batch differs (elastic-run: 4, short-async: 8): not the same workload",
        "caveat: engine.backend differs (elastic-run: vllm, short-async: embedded): not the"
        " same workload",
    ]


def test_comparing_runs_refuses_one_out_dir_and_writes_nothing_on_a_bad_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good"
    _write_run(good)
    assert main(["report", str(good), str(good), "--out", str(tmp_path / "r")]) == 2
    assert "--out DIR takes one RUN_DIR; got 2" in capsys.readouterr().err
    assert main(["report", str(good), str(tmp_path / "missing")]) == 2
    assert "no run directory" in capsys.readouterr().err
    assert not (good / "report").exists()


def test_a_log_written_before_newer_fields_still_reads(tmp_path: Path) -> None:
    old = [
        '{"kind": "run", "time_s": 0.0, "policy": "elastic", "mu": 2, "phi": 0.5, "cells": 3,'
        ' "predicted_staleness": 1.0, "group_size": 8, "batch": 4}',
        '{"kind": "load", "time_s": 1.0, "running": 3, "queued": 2, "capacity": 16}',
        '{"kind": "group", "time_s": 2.0, "group_id": 0, "dispatch_version": 0, "step": 0,'
        ' "staleness": 0}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(old) + "\n")
    metrics = read_metrics(tmp_path)
    assert metrics.run is not None and metrics.run.standalone_capacity == 0
    assert metrics.loads[0].waterlevel == 5
    assert math.isnan(metrics.groups[0].execution_staleness)
    # A required field is still required.
    (tmp_path / "metrics.jsonl").write_text(old[1].replace(', "queued": 2', "") + "\n")
    with pytest.raises(MetricsError, match="queued"):
        read_metrics(tmp_path)
