"""PNG plots of simulated runs: per-cell role timelines, rollout load, policy speedups.

Everything here uses matplotlib's object-oriented API (a :class:`Figure` attached to
its own :class:`FigureCanvasAgg`), never pyplot, so plotting touches no global state:
it works headless, in threads, and next to any backend the caller has chosen.

The ``*_figure`` functions build a figure (so tests and notebooks can inspect it);
the ``plot_*`` functions build, save and release one; :func:`write_plots` writes the
whole set for ``qwengyre simulate --plot DIR``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from qwengyre.scheduler.events import Role
from qwengyre.sim.simulator import LoadSample, RoleSpan, SimResult

FIGSIZE_IN: tuple[float, float] = (10.0, 4.0)
DPI = 120

#: Bar colour of each role in the timeline (opaque, so bar interiors are exactly this).
ROLE_COLOURS: dict[Role, str] = {
    Role.ROLLOUT: "#4c78a8",  # blue
    Role.TRAINING: "#e45756",  # red
    Role.TO_TRAINING: "#f2a516",  # amber
    Role.TO_ROLLOUT: "#54a24b",  # green
    Role.LOST: "#9d9d9d",  # grey
}
ROLE_LABELS: dict[Role, str] = {
    Role.ROLLOUT: "rollout",
    Role.TRAINING: "training",
    Role.TO_TRAINING: "rollout → training",
    Role.TO_ROLLOUT: "training → rollout",
    Role.LOST: "lost",
}
#: Legend / drawing order: the two steady roles, the transitions, then a lost cell.
_ROLE_ORDER: tuple[Role, ...] = (
    Role.ROLLOUT,
    Role.TRAINING,
    Role.TO_TRAINING,
    Role.TO_ROLLOUT,
    Role.LOST,
)
#: Transitions last seconds, far below one pixel of an hours-long axis; they are drawn
#: at least this fraction of the time axis wide so that they stay visible.
MIN_TRANSITION_FRACTION = 0.002

RUNNING_COLOUR = "#4c78a8"
QUEUED_COLOUR = "#f58518"
CAPACITY_COLOUR = "#333333"
STEP_LINE_COLOUR = "#555555"
BAR_COLOURS: dict[str, str] = {"elastic": "#4c78a8", "async": "#f58518", "colocate": "#72b7b2"}
_FALLBACK_BAR_COLOURS = ("#b279a2", "#9d755d", "#bab0ac", "#eeca3b", "#ff9da6")
#: The policy the speedup plot measures the others against.
REFERENCE_POLICY = "elastic"


@dataclass(frozen=True)
class TimeUnit:
    """The unit of a time axis: ``seconds`` per unit and its ``name``."""

    seconds: float
    name: str

    def of(self, seconds: float) -> float:
        return seconds / self.seconds

    @property
    def label(self) -> str:
        return f"time ({self.name})"


HOURS = TimeUnit(3600.0, "hours")


def time_unit(span_s: float) -> TimeUnit:
    """Hours for a run of 2 hours or more, minutes from 2 minutes, else seconds."""
    if span_s >= 2 * HOURS.seconds:
        return HOURS
    if span_s >= 2 * 60:
        return TimeUnit(60.0, "minutes")
    return TimeUnit(1.0, "seconds")


def _new_figure() -> Figure:
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        fig.clear()  # a pyplot-free figure has no manager to close; drop its artists
    return path


def _describe(result: SimResult) -> str:
    return f"{result.policy} (μ={result.mu}, φ={result.phi:g})"


def _cell_count(result: SimResult) -> int:
    spans = max((s.cell for s in result.role_spans), default=-1) + 1
    return max(len(result.cell_training_share), spans, 1)


def _end_s(result: SimResult) -> float:
    ends = [result.end_to_end_s, *(s.end_s for s in result.role_spans)]
    if result.load:
        ends.append(result.load[-1].time_s)
    return max([e for e in ends if math.isfinite(e)] + [1.0])


# ---------------------------------------------------------------- role timeline


def role_timeline_figure(result: SimResult) -> Figure:
    """One lane per cell (cell 0, the core, on top), bars coloured by role, time on x."""
    return spans_timeline_figure(
        result.role_spans,
        end_s=_end_s(result),
        cells=_cell_count(result),
        step_end_s=result.step_end_s,
        title=(
            f"Cell roles — {_describe(result)}:"
            f" {result.steps} steps in {HOURS.of(result.end_to_end_s):.2f} h"
        ),
    )


def spans_timeline_figure(
    spans: Sequence[RoleSpan],
    *,
    end_s: float,
    cells: int | None = None,
    step_end_s: Sequence[float] = (),
    title: str = "Cell roles",
    standalone_capacity: int = 0,
) -> Figure:
    """The role timeline drawn from plain spans: one lane per cell, time on x
    (:func:`time_unit` of ``end_s``).

    ``cells`` defaults to one more than the highest cell in ``spans`` (at least 1);
    ``step_end_s`` draws a thin vertical line at each step's end; a standalone pool
    (``standalone_capacity`` > 0) gets its own lane at the bottom, in rollout throughout.
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    if cells is None:
        cells = max(max((s.cell for s in spans), default=-1) + 1, 1)
    unit = time_unit(end_s)
    min_width = unit.of(end_s) * MIN_TRANSITION_FRACTION
    lane_height = 0.8
    by_cell_role: dict[tuple[int, Role], list[tuple[float, float]]] = {}
    for span in spans:
        start, width = unit.of(span.start_s), unit.of(span.end_s - span.start_s)
        if span.role in (Role.TO_TRAINING, Role.TO_ROLLOUT):
            width = max(width, min_width)
        by_cell_role.setdefault((span.cell, span.role), []).append((start, width))
    # Steady roles first, so that (widened) transitions are painted on top of them.
    for role in _ROLE_ORDER:
        for cell in range(cells):
            bars = by_cell_role.get((cell, role))
            if bars:
                ax.broken_barh(
                    bars,
                    (cell - lane_height / 2, lane_height),
                    facecolors=ROLE_COLOURS[role],
                    edgecolor="none",
                    linewidth=0,
                )
    labels = ["cell 0 (core)", *(f"cell {c}" for c in range(1, cells))]
    if standalone_capacity > 0:
        ax.broken_barh(
            [(0.0, unit.of(end_s))],
            (cells - lane_height / 2, lane_height),
            facecolors=ROLE_COLOURS[Role.ROLLOUT],
            edgecolor="none",
            linewidth=0,
        )
        labels.append(f"standalone ({standalone_capacity})")
    for step_end in step_end_s:
        ax.axvline(unit.of(step_end), color=STEP_LINE_COLOUR, linewidth=0.6, alpha=0.6, zorder=3)

    ax.set_ylim(len(labels) - 0.5, -0.5)  # cell 0 at the top
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    if cells > 16:  # keep labels legible on big clusters
        for i, label in enumerate(ax.get_yticklabels()):
            label.set_visible(i == 0 or i % max(1, cells // 8) == 0)
    ax.set_xlim(0.0, unit.of(end_s))
    ax.set_xlabel(unit.label)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    handles: list[Patch | Line2D] = [
        Patch(facecolor=ROLE_COLOURS[r], label=ROLE_LABELS[r])
        for r in _ROLE_ORDER
        if r is not Role.LOST or any(s.role is Role.LOST for s in spans)
    ]
    handles.append(
        Line2D([], [], color=STEP_LINE_COLOUR, linewidth=0.8, alpha=0.8, label="step done")
    )
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    return fig


def plot_role_timeline(result: SimResult, path: Path) -> Path:
    """Write the per-cell role timeline of ``result`` (like the paper's Figure 6a) to ``path``."""
    return _save(role_timeline_figure(result), path)


# ---------------------------------------------------------------- load


def _step_series(
    samples: Sequence[LoadSample], end_s: float, unit: TimeUnit
) -> tuple[list[float], list[int], list[int], list[int]]:
    """Sample times (in ``unit``, closed by the run's end) and the running/queued/capacity."""
    times = [unit.of(s.time_s) for s in samples]
    running = [s.running for s in samples]
    queued = [s.queued for s in samples]
    capacity = [s.capacity for s in samples]
    if samples:  # hold the last sample until the end of the run
        times.append(max(unit.of(end_s), times[-1]))
        running.append(running[-1])
        queued.append(queued[-1])
        capacity.append(capacity[-1])
    return times, running, queued, capacity


def load_figure(result: SimResult) -> Figure:
    """Running and queued executions (steps) and rollout capacity (dashed) over time."""
    return samples_load_figure(
        result.load,
        end_s=_end_s(result),
        title=f"Rollout load — {_describe(result)}: utilisation {result.rollout_utilisation:.0%}",
    )


def samples_load_figure(
    samples: Sequence[LoadSample], *, end_s: float, title: str = "Rollout load"
) -> Figure:
    """The load figure from plain samples, each held until the next (the last to ``end_s``)."""
    fig = _new_figure()
    ax = fig.add_subplot()
    unit = time_unit(end_s)
    times, running, queued, capacity = _step_series(samples, end_s, unit)
    ax.fill_between(times, running, step="post", color=RUNNING_COLOUR, alpha=0.15, linewidth=0)
    ax.step(times, running, where="post", color=RUNNING_COLOUR, linewidth=1.4, label="running")
    ax.step(times, queued, where="post", color=QUEUED_COLOUR, linewidth=1.4, label="queued")
    ax.step(
        times,
        capacity,
        where="post",
        color=CAPACITY_COLOUR,
        linewidth=1.2,
        linestyle="--",
        label="rollout capacity",
    )
    ax.set_xlim(0.0, max(unit.of(end_s), times[-1] if times else 0.0) or 1.0)
    peak = max([*running, *queued, *capacity, 0])
    ax.set_ylim(0.0, peak * 1.08 if peak > 0 else 1.0)
    ax.set_xlabel(unit.label)
    ax.set_ylabel("executions")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncol=3, frameon=False)
    return fig


def plot_load(result: SimResult, path: Path) -> Path:
    """Write running/queued executions and rollout capacity over time to ``path``."""
    return _save(load_figure(result), path)


# ---------------------------------------------------------------- speedups


def _reference(results: Mapping[str, SimResult]) -> str | None:
    if REFERENCE_POLICY in results:
        return REFERENCE_POLICY
    return next((k for k, r in results.items() if r.policy == REFERENCE_POLICY), None)


def speedups(results: Mapping[str, SimResult]) -> dict[str, float]:
    """End-to-end time of each other policy over elastic's (> 1: elastic is faster).

    Empty when no result is elastic's.
    """
    ref = _reference(results)
    if ref is None:
        return {}
    base = results[ref].end_to_end_s
    return {k: r.end_to_end_s / base for k, r in results.items() if k != ref}


def _bar_colours(names: Sequence[str], results: Mapping[str, SimResult]) -> list[str]:
    colours, spare = [], iter(_FALLBACK_BAR_COLOURS * (1 + len(names)))
    for name in names:
        colour = BAR_COLOURS.get(name) or BAR_COLOURS.get(results[name].policy)
        colours.append(colour if colour is not None else next(spare))
    return colours


def speedup_figure(results: Mapping[str, SimResult]) -> Figure:
    """Bars of end-to-end hours per policy, each run's lower bound dashed across its bar,
    elastic's speedups."""
    fig = _new_figure()
    ax = fig.add_subplot()
    names = list(results)
    hours = [HOURS.of(results[n].end_to_end_s) for n in names]
    xs = list(range(len(names)))
    bars = ax.bar(xs, hours, width=0.6, color=_bar_colours(names, results), zorder=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{n}\nμ={results[n].mu}, φ={results[n].phi:g}" for n in names])
    ax.set_ylabel("end-to-end time (hours)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    bounds = [HOURS.of(results[n].bound.seconds) for n in names]
    finite = [b for b in bounds if math.isfinite(b) and b > 0]
    for i, (x, b) in enumerate(zip(xs, bounds, strict=True)):
        if math.isfinite(b) and b > 0:
            ax.hlines(
                b,
                x - 0.4,
                x + 0.4,
                colors=CAPACITY_COLOUR,
                linestyles="--",
                linewidth=1.2,
                zorder=3,
                label="lower bound of the run" if i == 0 else "_nolegend_",
            )

    ratio = speedups(results)
    top = max([*hours, *finite, 0.0])
    for name, bar, h in zip(names, bars, hours, strict=True):
        x = bar.get_x() + bar.get_width() / 2
        ax.annotate(
            f"{h:.2f} h",
            (x, h),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
        if name in ratio and h > 0:
            ax.annotate(
                f"{ratio[name]:.2f}x",
                (x, h),
                xytext=(0, -8),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=13,
                fontweight="bold",
                color="white",
                zorder=4,
                # the bar's own colour behind the text masks the lower-bound line
                bbox={"boxstyle": "round,pad=0.2", "facecolor": bar.get_facecolor(), "lw": 0},
            )
    ax.set_ylim(0.0, top * 1.15 if top > 0 else 1.0)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ref = _reference(results)
    steps = sorted({r.steps for r in results.values()})
    steps_txt = f"{steps[0]} steps" if len(steps) == 1 else "steps " + "/".join(map(str, steps))
    suffix = f"; bars show {ref}'s speedup over each" if ref is not None and ratio else ""
    ax.set_title(f"End-to-end time for {steps_txt}{suffix}")
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", frameon=False)
    return fig


def plot_speedups(results: Mapping[str, SimResult], path: Path) -> Path:
    """Write end-to-end hours per policy with elastic's speedup over the others to ``path``."""
    if not results:
        raise ValueError("plot_speedups needs at least one result")
    return _save(speedup_figure(results), path)


# ---------------------------------------------------------------- all at once


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"


def write_plots(results: Mapping[str, SimResult], out_dir: Path) -> list[Path]:
    """Write ``timeline_<policy>.png`` and ``load_<policy>.png`` per result into ``out_dir``.

    ``<policy>`` is the mapping key (the policy name for ``qwengyre simulate``), made
    safe for a file name. With more than one result, ``speedup.png`` too. Returns the
    paths written, in that order.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name, result in results.items():
        stem = _file_stem(name)
        paths.append(plot_role_timeline(result, out / f"timeline_{stem}.png"))
        paths.append(plot_load(result, out / f"load_{stem}.png"))
    if len(results) > 1:
        paths.append(plot_speedups(results, out / "speedup.png"))
    return paths


# ---------------------------------------------------------------- time vs staleness


def staleness_sweep_figure(points: Mapping[str, Sequence[tuple[float, float, str]]]) -> Figure:
    """One line per policy: its best end-to-end time (hours) at each target E[d], each
    point labelled with the shape that reached it. ``points``: per policy,
    ``(target, seconds, shape)`` (:func:`qwengyre.sim.plan.best_times`)."""
    fig = _new_figure()
    ax = fig.add_subplot()
    names = list(points)
    spare = iter(_FALLBACK_BAR_COLOURS * (1 + len(names)))
    colours = {name: BAR_COLOURS.get(name) or next(spare) for name in names}
    for name, series in points.items():
        ordered = sorted(series)
        xs = [target for target, _, _ in ordered]
        hours = [HOURS.of(seconds) for _, seconds, _ in ordered]
        ax.plot(xs, hours, marker="o", color=colours[name], label=name, zorder=3)
        for x, h, (_, _, shape) in zip(xs, hours, ordered, strict=True):
            ax.annotate(
                shape,
                (x, h),
                xytext=(4, 4),
                textcoords="offset points",
                fontsize=7,
                color=colours[name],
            )
    targets = sorted({t for series in points.values() for t, _, _ in series})
    ax.set_xticks(targets)
    ax.margins(x=0.15)  # room for the labels of the last points
    ax.set_xlabel("target staleness E[d] (steps)")
    ax.set_ylabel("end-to-end time (hours)")
    ax.grid(alpha=0.3, zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title("Best end-to-end time per policy against target staleness")
    if names:
        ax.legend(frameon=False)
    return fig


def plot_staleness_sweep(
    points: Mapping[str, Sequence[tuple[float, float, str]]], path: Path
) -> Path:
    """Write :func:`staleness_sweep_figure` to ``path``."""
    if not any(points.values()):
        raise ValueError("plot_staleness_sweep needs at least one point")
    return _save(staleness_sweep_figure(points), path)


# ---------------------------------------------------------------- paper ablations

#: Bar colour of each family of ablation rows, by the row name's first letter.
ABLATION_COLOURS: dict[str, str] = {
    "A": BAR_COLOURS["async"],
    "C": BAR_COLOURS["colocate"],
    "E": BAR_COLOURS["elastic"],
}
PAPER_COLOUR = "#9e9e9e"
DISAGREE_COLOUR = "#c62828"


def ablations_figure(
    hours: Mapping[str, tuple[float, float, float]],
    paper_hours: Mapping[str, float],
    changes: Sequence[tuple[str, float, float, bool]],
) -> Figure:
    """Left: each row's mean end-to-end hours, its min-max over seeds as an error bar,
    rows grouped by family (A, C, E: the name's first letter), the paper's stated hours
    as markers. Right: each paper figure as the row's change in time against its
    reference, ours beside the paper's, labels in red where the directions disagree.

    ``hours``: row -> (mean, min, max); ``changes``: (label, ours %, paper %, agrees)
    (:meth:`qwengyre.sim.ablations.AblationResult.changes`).
    """
    fig = _new_figure()
    fig.set_size_inches(12.0, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    names = list(hours)
    xs, x, family = [], 0.0, None
    for name in names:
        if family is not None and name[:1] != family:
            x += 0.8  # a gap between families
        family = name[:1]
        xs.append(x)
        x += 1.0
    spare = iter(_FALLBACK_BAR_COLOURS * (1 + len(names)))
    colours = {
        f: ABLATION_COLOURS.get(f) or next(spare) for f in dict.fromkeys(n[:1] for n in names)
    }
    means = [hours[n][0] for n in names]
    errors = [
        [m - hours[n][1] for n, m in zip(names, means, strict=True)],
        [hours[n][2] - m for n, m in zip(names, means, strict=True)],
    ]
    left.bar(xs, means, width=0.7, color=[colours[n[:1]] for n in names], zorder=2)
    left.errorbar(xs, means, yerr=errors, fmt="none", ecolor=CAPACITY_COLOUR, capsize=3, zorder=3)
    for xi, n, m in zip(xs, names, means, strict=True):
        left.annotate(
            f"{m:.1f}",
            (xi, hours[n][2]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    stated = [(xi, paper_hours[n]) for xi, n in zip(xs, names, strict=True) if n in paper_hours]
    if stated:
        left.scatter(
            *zip(*stated, strict=True),
            marker="D",
            color="black",
            zorder=4,
            label="paper's stated hours",
        )
        left.legend(frameon=False, loc="upper right")
    left.set_xticks(xs)
    left.set_xticklabels(names)
    left.set_ylabel("end-to-end time (hours)")
    left.set_title("Mean time per row (min-max over seeds)")

    ys = list(range(len(changes)))[::-1]
    height = 0.38
    right.barh(
        [y + height / 2 for y in ys],
        [c[1] for c in changes],
        height=height,
        color=[colours.get(c[0][:1], PAPER_COLOUR) for c in changes],
        zorder=2,
    )
    right.barh(
        [y - height / 2 for y in ys], [c[2] for c in changes], height=height, color=PAPER_COLOUR
    )
    right.axvline(0.0, color=CAPACITY_COLOUR, linewidth=0.8)
    right.set_yticks(ys)
    right.set_yticklabels([c[0] for c in changes])
    for tick, change in zip(right.get_yticklabels(), changes, strict=True):
        if not change[3]:
            tick.set_color(DISAGREE_COLOUR)
    right.set_xlabel("row's time vs reference (%)")
    right.set_title("Paper's figures: ours vs paper (red: disagree)")
    families = [f for f in colours if any(c[0][:1] == f for c in changes)]
    handles = [Patch(color=colours[f], label=f"ours ({f} rows)") for f in families]
    right.legend(
        handles=[*handles, Patch(color=PAPER_COLOUR, label="paper")],
        frameon=False,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    for ax in (left, right):
        ax.grid(axis="y" if ax is left else "x", alpha=0.3, zorder=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig


def plot_ablations(
    hours: Mapping[str, tuple[float, float, float]],
    paper_hours: Mapping[str, float],
    changes: Sequence[tuple[str, float, float, bool]],
    path: Path,
) -> Path:
    """Write :func:`ablations_figure` to ``path``."""
    if not hours:
        raise ValueError("plot_ablations needs at least one row")
    return _save(ablations_figure(hours, paper_hours, changes), path)
