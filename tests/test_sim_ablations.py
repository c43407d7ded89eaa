"""The paper's ablation rows in the simulator (``simulate --ablations``), on small runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwengyre.cli import main
from qwengyre.config import Config, load_config
from qwengyre.presets import preset_path
from qwengyre.sim.ablations import (
    FIGURES,
    ROWS,
    STEPS,
    AblationResult,
    PaperFigure,
    run_ablations,
    without_training,
)
from qwengyre.sim.plots import DISAGREE_COLOUR, ablations_figure
from qwengyre.sim.simulator import simulate
from qwengyre.sim.workload import workload_from_name

SMALL = ["groups.batch=4", "cells.capacity=18"]
"""The paper-122b setup with an eighth of its batch and rollout slots (seconds, not minutes)."""


def paper(*overrides: str) -> Config:
    return load_config(preset_path("paper-122b"), list(overrides), {})


@pytest.fixture(scope="module")
def small() -> AblationResult:
    return run_ablations(paper(*SMALL, f"sim.steps={STEPS}"), 2)


# name: policy, mu, phi, streaming, cells, capacity, standalone, async split, tokens/s
EXPECTED = {
    "A0": ("async", 1, 1.5, False, 8, 144, 0, 2, 10_000),
    "A1": ("async", 1, 1.5, False, 8, 144, 0, 1, 10_000),
    "A2": ("async", 3, 0.5, False, 8, 144, 0, 2, 10_000),
    "A3": ("async", 1, 1.5, True, 8, 144, 0, 2, 10_000),
    "C0": ("colocate", 4, 0.0, False, 8, 144, 0, None, 10_000),
    "C1": ("colocate", 3, 0.5, False, 7, 144, 144, None, 10_000),
    "C2": ("colocate", 3, 0.5, True, 7, 144, 144, None, 10_000),
    "C3": ("colocate", 3, 0.5, True, 6, 144, 288, None, 10_000),
    "E0": ("elastic", 3, 0.5, True, 8, 144, 0, None, 10_000),
    "E1": ("elastic", 1, 1.5, True, 8, 144, 0, None, 10_000),
    "E2": ("elastic", 3, 0.5, True, 4, 288, 0, None, 20_000),
}


def test_each_row_runs_the_setting_its_description_names():
    base = paper()
    assert [row.name for row in ROWS] == list(EXPECTED)
    for row in ROWS:
        c = row.config(base)
        s = c.scheduler
        policy, mu, phi, streaming, count, capacity, standalone, split, rate = EXPECTED[row.name]
        assert (s.policy, s.mu, s.phi, s.streaming) == (policy, mu, phi, streaming), row.name
        assert (c.cells.count, c.cells.capacity, c.cells.standalone_capacity) == (
            count,
            capacity,
            standalone,
        ), row.name
        # every row keeps the paper's 32 nodes: 8 cells' worth of capacity
        assert c.cells.count * c.cells.capacity + c.cells.standalone_capacity == 8 * 144
        if split is not None:
            assert s.async_training_cells == split, row.name
        assert c.sim.train_tokens_per_cell_s == rate, row.name
        assert c.groups == base.groups and c.sim.steps == base.sim.steps


def test_rows_refuse_a_base_they_cannot_derive_from():
    by_name = {row.name: row for row in ROWS}
    with pytest.raises(ValueError, match=r"E2 regroups every 2 cells.*cells.count=7"):
        by_name["E2"].config(paper("cells.count=7"))
    with pytest.raises(ValueError, match=r"A1 moves 1 .*must be at least 2"):
        by_name["A1"].config(paper("scheduler.async_training_cells=1"))


def test_figures_compute_percent_change_and_speedup():
    slower = PaperFigure(row="X", reference="Y", paper=7.6, kind="percent")
    assert slower.measure(11.0, 10.0) == pytest.approx(10.0)
    assert slower.agrees(10.0) and not slower.agrees(-3.0)
    assert not slower.agrees(0.4)  # a tie (< TIE_PERCENT) goes no way
    faster = PaperFigure(row="X", reference="Y", paper=1.19, kind="speedup")
    assert faster.measure(10.0, 12.0) == pytest.approx(1.2)  # Y's time over X's
    assert faster.change_percent(1.25) == pytest.approx(-20.0)
    assert faster.agrees(1.2) and not faster.agrees(0.9)
    assert (faster.format(1.234), slower.format(-2.94)) == ("1.23x", "-2.9%")


def test_every_paper_figure_is_measured_from_the_rows(small: AblationResult):
    assert [(m.figure.row, m.figure.reference) for m in small.figures] == [
        (f.row, f.reference) for f in FIGURES
    ]
    for m in small.figures:
        f, row, ref = m.figure, small.rows[m.figure.row], small.rows[m.figure.reference]
        if f.kind == "percent":
            assert m.ours == pytest.approx((row.mean_hours / ref.mean_hours - 1) * 100)
        else:
            assert m.ours == pytest.approx(ref.mean_hours / row.mean_hours)
        per_seed = [f.measure(a, b) for a, b in zip(row.hours(), ref.hours(), strict=True)]
        assert (m.low, m.high) == (min(per_seed), max(per_seed))
        assert m.single_low <= m.low <= m.high <= m.single_high
        assert m.agrees == f.agrees(m.ours)
    summary = json.loads(json.dumps(small.summary()))
    assert summary["seeds"] == [0, 1] and summary["steps"] == STEPS
    assert [f["agrees"] for f in summary["figures"]] == [m.agrees for m in small.figures]


def test_rows_of_a_seed_run_on_that_seeds_executions(small: AblationResult):
    workload = workload_from_name("paper-122b", 1)
    for name in ("A2", "C3", "E2"):
        row = small.rows[name]
        assert row.runs[1].end_to_end_s == simulate(row.config, workload).end_to_end_s
        free = simulate(without_training(row.config), workload)
        assert row.rollout_only[1].end_to_end_s == free.end_to_end_s


def test_rows_hold_the_paper_staleness_and_its_robust_relations(small: AblationResult):
    for name, row in small.rows.items():
        for run in row.runs:
            assert abs(run.mean_staleness - 1.5) <= 0.05, name  # Eq 2 at E[d] = 1.5
        assert row.exposed_training_hours >= 0, name
    hours = {name: row.hours() for name, row in small.rows.items()}
    for seed in range(2):
        assert hours["A3"][seed] < hours["A0"][seed]  # streaming starts training earlier
        assert hours["E1"][seed] > hours["E0"][seed]  # E1 +10.9% in the paper


def test_seed_counts_must_be_positive():
    with pytest.raises(ValueError, match="number of seeds must be at least 1, got 0"):
        run_ablations(paper(*SMALL), 0)
    with pytest.raises(ValueError, match="at least one seed"):
        run_ablations(paper(*SMALL), [])


def test_cli_runs_the_ablations_with_json_and_plot(tmp_path: Path, capsys):
    out, plots = tmp_path / "ablations.json", tmp_path / "plots"
    args = ["simulate", "--ablations", "--seeds", "1", *SMALL, "--json", str(out)]
    assert main([*args, "--plot", str(plots)]) == 0
    printed = capsys.readouterr().out
    assert "Paper ablations at E[d] = 1.5: paper-122b, 12 steps, seed 0" in printed
    assert "The paper's figures" in printed
    summary = json.loads(out.read_text())
    assert summary["steps"] == STEPS and summary["seeds"] == [0]  # the paper's 12 steps
    assert list(summary["rows"]) == list(EXPECTED)
    assert summary["rows"]["E2"]["settings"] == "elastic, 4x36, mu 3 phi 0.5, streaming"
    disagreeing = [f for f in summary["figures"] if not f["agrees"]]
    for figure in disagreeing:
        assert f"{figure['row']} vs {figure['reference']}:" in printed
    assert (plots / "ablations.png").read_bytes()[:4] == b"\x89PNG"

    assert main(["simulate", "--ablations", "--seeds", "1", *SMALL, "sim.steps=2"]) == 0
    assert "2 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ablations", "--seeds", "0"], "the number of seeds must be at least 1, got 0"),
        (["--seeds", "2"], "--seeds applies to --ablations only"),
        (["--ablations", "--compare"], "drop --compare and --target-staleness"),
    ],
)
def test_cli_refuses_bad_ablation_arguments(args: list[str], message: str, capsys):
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


def test_plot_marks_the_figures_that_disagree():
    hours = {"A0": (20.0, 19.0, 21.0), "A1": (22.0, 21.5, 22.5), "E0": (17.0, 16.8, 17.2)}
    changes = [("A1 vs A0", 10.0, 7.7, True), ("E0 vs A0", -15.0, 5.0, False)]
    fig = ablations_figure(hours, {"E0": 16.12}, changes)
    left, right = fig.axes
    assert [t.get_text() for t in left.get_xticklabels()] == ["A0", "A1", "E0"]
    assert [p.get_height() for p in left.patches] == [20.0, 22.0, 17.0]
    assert sorted(p.get_width() for p in right.patches) == [-15.0, 5.0, 7.7, 10.0]
    colours = {t.get_text(): t.get_color() for t in right.get_yticklabels()}
    assert colours["E0 vs A0"] == DISAGREE_COLOUR and colours["A1 vs A0"] != DISAGREE_COLOUR
