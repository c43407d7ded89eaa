"""PNG plots of simulated runs: real files, read back and checked pixel by pixel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.image import imread
from numpy.typing import NDArray

from qwengyre.config import load_config
from qwengyre.scheduler.events import Role
from qwengyre.sim.bound import RunBound
from qwengyre.sim.plots import (
    DPI,
    FIGSIZE_IN,
    QUEUED_COLOUR,
    ROLE_COLOURS,
    RUNNING_COLOUR,
    load_figure,
    plot_load,
    plot_role_timeline,
    plot_speedups,
    role_timeline_figure,
    spans_timeline_figure,
    speedup_figure,
    speedups,
    time_unit,
    write_plots,
)
from qwengyre.sim.simulator import LoadSample, RoleSpan, SimResult, simulate
from qwengyre.sim.workload import FixedWorkload

HOUR = 3600.0
WIDTH_PX, HEIGHT_PX = round(FIGSIZE_IN[0] * DPI), round(FIGSIZE_IN[1] * DPI)


def _simulate(policy: str, steps: int = 6) -> SimResult:
    cfg = load_config(
        None,
        [f"scheduler.policy={policy}", "scheduler.target_staleness=1.5", f"sim.steps={steps}"],
    )
    return simulate(cfg, FixedWorkload(duration_s=HOUR))


@pytest.fixture(scope="module")
def results() -> dict[str, SimResult]:
    return {p: _simulate(p) for p in ("elastic", "async", "colocate")}


def _synthetic(spans: list[RoleSpan], cells: int, end_s: float) -> SimResult:
    """A hand-made two-step result with the given role spans and a simple load."""
    load = [
        LoadSample(0.0, running=6, queued=4, capacity=8),
        LoadSample(end_s / 2, running=3, queued=0, capacity=4),
    ]
    return SimResult(
        policy="elastic",
        mu=2,
        phi=0.5,
        steps=2,
        end_to_end_s=end_s,
        step_end_s=[end_s / 2, end_s],
        mean_staleness=1.0,
        mean_staleness_all=1.0,
        predicted_staleness=1.0,
        mean_execution_staleness=1.0,
        bound=RunBound(resource_s=end_s * 0.8, littles_law_s=0.0, critical_chain_s=0.0),
        cell_training_share=[0.0] * cells,
        rollout_utilisation=0.5,
        launched=10,
        cancelled=0,
        groups_dropped=0,
        reroutes=0,
        publications=1,
        core_kept=0,
        stalls=0,
        role_spans=spans,
        load=load,
    )


def _read_png(path: Path) -> NDArray[np.float32]:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = np.asarray(imread(path))
    assert img.shape[:2] == (HEIGHT_PX, WIDTH_PX)  # 10 x 4 in at 120 dpi: aspect 2.5
    assert img.shape[2] in (3, 4)
    assert float(img[..., :3].var()) > 0.0  # not blank
    return img


def _mask(img: NDArray[np.float32], colour: str, tol: float = 1.5 / 255) -> NDArray[np.bool_]:
    rgb = np.asarray(to_rgb(colour), dtype=np.float32)
    return np.all(np.abs(img[..., :3] - rgb) <= tol, axis=-1)


def _to_pixel(fig: Figure, x_h: float, y: float) -> tuple[int, int]:
    """(row, column) in the saved PNG of data point (x hours, y) of the figure's axes."""
    fig.canvas.draw()
    px, py = fig.axes[0].transData.transform((x_h, y))
    return HEIGHT_PX - 1 - round(py), round(px)


def _axes_box(fig: Figure) -> tuple[slice, slice]:
    """Rows and columns of the saved PNG inside the (first) axes, legend excluded."""
    fig.canvas.draw()
    box = fig.axes[0].get_window_extent()
    rows = slice(HEIGHT_PX - round(box.y1), HEIGHT_PX - round(box.y0))
    return rows, slice(round(box.x0), round(box.x1))


# ---------------------------------------------------------------- role timeline


def test_timeline_png_shows_training_of_the_core_cell(
    results: dict[str, SimResult], tmp_path: Path
) -> None:
    result = results["elastic"]
    assert result.cell_training_share[0] > 0.1  # the core cell trained
    out = plot_role_timeline(result, tmp_path / "sub" / "timeline.png")
    assert out == tmp_path / "sub" / "timeline.png"
    img = _read_png(out)
    rows, cols = _axes_box(role_timeline_figure(result))
    plot_area = img[rows, cols]
    # Training and rollout bars are painted in the plot area, not just in the legend.
    assert _mask(plot_area, ROLE_COLOURS[Role.TRAINING]).sum() > 1000
    assert _mask(plot_area, ROLE_COLOURS[Role.ROLLOUT]).sum() > 1000
    # ... and the core cell's own lane is red where it trained.
    fig = role_timeline_figure(result)
    span = next(s for s in result.role_spans if s.cell == 0 and s.role is Role.TRAINING)
    row, col = _to_pixel(fig, (span.start_s + span.end_s) / 2 / HOUR, 0.0)
    assert _mask(img[row : row + 1, col - 3 : col + 4], ROLE_COLOURS[Role.TRAINING]).any()


def test_timeline_lanes_pixels_follow_the_spans(tmp_path: Path) -> None:
    """Cell 0 on top trains in the second half; cell 1 only rolls out; a 5 s switch shows."""
    end = 10 * HOUR
    spans = [
        RoleSpan(0, Role.ROLLOUT, 0.0, 5 * HOUR),
        RoleSpan(0, Role.TO_TRAINING, 5 * HOUR, 5 * HOUR + 5.0),
        RoleSpan(0, Role.TRAINING, 5 * HOUR + 5.0, end),
        RoleSpan(1, Role.ROLLOUT, 0.0, end),
    ]
    result = _synthetic(spans, cells=2, end_s=end)
    img = _read_png(plot_role_timeline(result, tmp_path / "t.png"))
    fig = role_timeline_figure(result)
    training, rollout = ROLE_COLOURS[Role.TRAINING], ROLE_COLOURS[Role.ROLLOUT]

    row0, col_late = _to_pixel(fig, 7.5, 0.0)
    _, col_early = _to_pixel(fig, 2.5, 0.0)
    row1, _ = _to_pixel(fig, 7.5, 1.0)
    assert row0 < row1  # cell 0 is the upper lane
    assert _mask(img[row0 : row0 + 1, col_late : col_late + 1], training).all()
    assert _mask(img[row0 : row0 + 1, col_early : col_early + 1], rollout).all()
    assert _mask(img[row1 : row1 + 1, col_late : col_late + 1], rollout).all()
    # cell 1 never trained: no red anywhere in its lane
    assert not _mask(img[row1 - 5 : row1 + 6], training).any()
    # the 5-second switch is widened enough to be seen in cell 0's lane
    _, col_switch = _to_pixel(fig, 5.0, 0.0)
    lane0 = img[row0 : row0 + 1, col_switch - 4 : col_switch + 5]
    assert _mask(lane0, ROLE_COLOURS[Role.TO_TRAINING]).any()


def test_timeline_without_training_paints_no_training_bar(tmp_path: Path) -> None:
    end = 4 * HOUR
    result = _synthetic([RoleSpan(c, Role.ROLLOUT, 0.0, end) for c in range(3)], 3, end)
    img = _read_png(plot_role_timeline(result, tmp_path / "t.png"))
    rows, cols = _axes_box(role_timeline_figure(result))
    assert not _mask(img[rows, cols], ROLE_COLOURS[Role.TRAINING]).any()
    assert _mask(img[rows, cols], ROLE_COLOURS[Role.ROLLOUT]).sum() > 1000
    # the legend (outside the axes) still shows the training swatch
    assert _mask(img, ROLE_COLOURS[Role.TRAINING]).any()


def test_timeline_figure_layout(results: dict[str, SimResult]) -> None:
    result = results["elastic"]
    fig = role_timeline_figure(result)
    ax = fig.axes[0]
    cells = len(result.cell_training_share)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["cell 0 (core)", *(f"cell {c}" for c in range(1, cells))]
    bottom, top = ax.get_ylim()
    assert top < bottom  # inverted: cell 0 at the top
    assert ax.get_xlim() == pytest.approx((0.0, result.end_to_end_s / HOUR))
    # one thin vertical line per completed step, at the step's end (hours)
    vlines = sorted(float(line.get_xdata()[0]) for line in ax.get_lines())
    assert vlines == pytest.approx([t / HOUR for t in result.step_end_s])
    title = ax.get_title()
    assert "elastic" in title and f"μ={result.mu}" in title and f"φ={result.phi:g}" in title
    legend_texts = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"rollout", "training", "step done"} <= legend_texts
    assert len(legend_texts) == 5


def test_the_time_axis_unit_follows_the_run_length() -> None:
    assert [time_unit(s).name for s in (90, 392, 7200)] == ["seconds", "minutes", "hours"]
    spans = [RoleSpan(0, Role.ROLLOUT, 0.0, 300.0), RoleSpan(0, Role.TRAINING, 300.0, 392.0)]
    ax = spans_timeline_figure(spans, end_s=392.0).axes[0]
    assert ax.get_xlabel() == "time (minutes)"
    assert ax.get_xlim() == pytest.approx((0.0, 392.0 / 60))


# ---------------------------------------------------------------- load


def test_load_png_and_series(results: dict[str, SimResult], tmp_path: Path) -> None:
    result = results["elastic"]
    img = _read_png(plot_load(result, tmp_path / "load.png"))
    rows, cols = _axes_box(load_figure(result))
    assert _mask(img[rows, cols], RUNNING_COLOUR).sum() > 200
    assert _mask(img[rows, cols], QUEUED_COLOUR).sum() > 50

    fig = load_figure(result)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"running", "queued", "rollout capacity"}
    assert lines["rollout capacity"].get_linestyle() == "--"
    assert lines["running"].get_drawstyle() == "steps-post"
    assert lines["rollout capacity"].get_drawstyle() == "steps-post"
    xs = np.asarray(lines["running"].get_xdata(), dtype=float)
    running = np.asarray(lines["running"].get_ydata(), dtype=float)
    capacity = np.asarray(lines["rollout capacity"].get_ydata(), dtype=float)
    # every sample plotted, held until the end of the run
    assert xs[:-1] == pytest.approx([s.time_s / HOUR for s in result.load])
    assert xs[-1] == pytest.approx(result.end_to_end_s / HOUR)
    assert running[:-1].tolist() == [s.running for s in result.load]
    assert capacity[:-1].tolist() == [s.capacity for s in result.load]
    assert running[-1] == result.load[-1].running
    title = ax.get_title()
    assert "elastic" in title and f"μ={result.mu}" in title and f"φ={result.phi:g}" in title


def test_load_of_synthetic_result_is_stepwise(tmp_path: Path) -> None:
    end = 2 * HOUR
    result = _synthetic([RoleSpan(0, Role.ROLLOUT, 0.0, end)], 1, end)
    img = _read_png(plot_load(result, tmp_path / "load.png"))
    fig = load_figure(result)
    # at 0.5 h the running line sits at 6 (its first sample), at 1.5 h at 3
    for x_h, running in ((0.5, 6), (1.5, 3)):
        row, col = _to_pixel(fig, x_h, running)
        patch = img[row - 2 : row + 3, col : col + 1]
        assert _mask(patch, RUNNING_COLOUR, tol=0.06).any(), (x_h, running)


# ---------------------------------------------------------------- speedups


def test_speedups_values(results: dict[str, SimResult]) -> None:
    ratio = speedups(results)
    base = results["elastic"].end_to_end_s
    assert set(ratio) == {"async", "colocate"}
    for name in ratio:
        assert ratio[name] == pytest.approx(results[name].end_to_end_s / base)
    assert speedups({"async": results["async"]}) == {}


def test_speedup_plot_three_policies(results: dict[str, SimResult], tmp_path: Path) -> None:
    img = _read_png(plot_speedups(results, tmp_path / "speedup.png"))
    fig = speedup_figure(results)
    ax = fig.axes[0]
    assert img.shape[:2] == (HEIGHT_PX, WIDTH_PX)
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 3
    heights = [b.get_height() for b in bars]
    assert heights == pytest.approx([results[p].end_to_end_s / HOUR for p in results])
    texts = [t.get_text() for t in ax.texts]
    ratio = speedups(results)
    for name in ("async", "colocate"):
        assert f"{ratio[name]:.2f}x" in texts
    assert sum(t.endswith("x") for t in texts) == 2  # none on elastic's own bar
    # each run's own lower bound, dashed across its bar
    marks = [np.asarray(c.get_segments()[0]) for c in ax.collections]
    assert [float(m[0, 1]) for m in marks] == pytest.approx(
        [r.bound.seconds / HOUR for r in results.values()]
    )
    for mark, bar in zip(marks, bars, strict=True):
        assert mark[0, 0] < bar.get_x() + bar.get_width() / 2 < mark[1, 0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert [t.split("\n")[0] for t in ticks] == list(results)
    assert all("μ=" in t and "φ=" in t for t in ticks)


def test_speedup_plot_bar_colours_in_pixels(results: dict[str, SimResult], tmp_path: Path) -> None:
    img = _read_png(plot_speedups(results, tmp_path / "speedup.png"))
    fig = speedup_figure(results)
    rows, cols = _axes_box(fig)
    for bar in fig.axes[0].patches:
        r, g, b, _ = bar.get_facecolor()
        rgb = "#{:02x}{:02x}{:02x}".format(*(round(255 * v) for v in (r, g, b)))
        assert _mask(img[rows, cols], rgb).sum() > 1000, rgb


def test_speedup_plot_bounds_per_bar_when_they_differ(tmp_path: Path) -> None:
    """Each run has its own lower bound: one dashed mark per bar, at that run's bound."""
    spans = [RoleSpan(0, Role.ROLLOUT, 0.0, 4 * HOUR)]
    short = _synthetic(spans, 1, 4 * HOUR)
    long = _synthetic([RoleSpan(0, Role.ROLLOUT, 0.0, 6 * HOUR)], 1, 6 * HOUR)
    long.policy = "async"
    results = {"elastic": short, "async": long}
    _read_png(plot_speedups(results, tmp_path / "s.png"))
    ax = speedup_figure(results).axes[0]
    assert not [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    marks = [np.asarray(c.get_segments()[0]) for c in ax.collections]
    assert sorted(float(m[0, 1]) for m in marks) == pytest.approx([3.2, 4.8])
    assert [t.get_text() for t in ax.texts if t.get_text().endswith("x")] == ["1.50x"]


def test_plot_speedups_needs_results(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_speedups({}, tmp_path / "s.png")


# ---------------------------------------------------------------- write_plots


def test_write_plots_three_policies(results: dict[str, SimResult], tmp_path: Path) -> None:
    out = tmp_path / "plots" / "nested"
    paths = write_plots(results, out)
    expected = [
        out / name
        for p in ("elastic", "async", "colocate")
        for name in (f"timeline_{p}.png", f"load_{p}.png")
    ] + [out / "speedup.png"]
    assert paths == expected
    assert sorted(f.name for f in out.iterdir()) == sorted(p.name for p in expected)
    for path in paths:
        _read_png(path)


def test_write_plots_single_result_has_no_speedup(
    results: dict[str, SimResult], tmp_path: Path
) -> None:
    paths = write_plots({"async": results["async"]}, tmp_path)
    assert [p.name for p in paths] == ["timeline_async.png", "load_async.png"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["load_async.png", "timeline_async.png"]
