"""A training run's report: ``RUN_DIR/report/index.html`` and its PNG figures.

Built from ``RUN_DIR/metrics.jsonl`` alone (see :mod:`qwengyre.records.metrics`):

- ``reward.png``: mean reward per step with a ± one standard deviation band, steps with
  no learning signal (nothing packed: every advantage zero) marked;
- ``timeline.png``: each cell's role over time (like the paper's Figure 6a), drawn
  by :mod:`qwengyre.sim.plots` from spans built out of the ``role`` records;
- ``load.png``: running and queued executions and rollout capacity over time;
- ``staleness.png``: the histogram of the trained groups' staleness against Eq 2;
- ``switches.png``: each measured switch's duration, by direction;
- ``training.png``: per step, the loss, the fraction of executions whose ratio was
  clipped, the gradient norm before clipping, the trained tokens per execution, the mean
  execution ratio and the KL of the behaviour policy to the trained one.

The page is self-contained apart from those images (relative links); a figure whose
records are missing (no switches under async, say) is replaced by a short note. A run
that learned nothing -- the reward never moved, or no step had a learning signal -- gets
a warning at the top (:func:`learning_signal_warning`, also printed by ``qwengyre train``),
and the summary counts the steps with no learning signal.
Matplotlib's object-oriented API only, as in :mod:`qwengyre.sim.plots`.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from qwengyre.records.assessments import (
    ASSESSMENTS_FILE,
    Assessment,
    AssessmentRecord,
    read_assessments,
)
from qwengyre.records.metrics import (
    METRICS_FILE,
    SWITCH_DIRECTIONS,
    GroupRecord,
    RoleRecord,
    RunMetrics,
    StepRecord,
    SwitchRecord,
    read_metrics,
)
from qwengyre.scheduler.events import Role
from qwengyre.scheduler.staleness import steady_steps
from qwengyre.sim.plots import (
    QUEUED_COLOUR,
    ROLE_COLOURS,
    RUNNING_COLOUR,
    _new_figure,
    _save,
    samples_load_figure,
    spans_timeline_figure,
    time_unit,
)
from qwengyre.sim.simulator import LoadSample, RoleSpan

REPORT_DIR = "report"
INDEX_FILE = "index.html"
PREDICTION_COLOUR = "#333333"
NO_SIGNAL_COLOUR = "#d62728"
SWITCH_COLOURS: dict[str, str] = {
    "training": ROLE_COLOURS[Role.TO_TRAINING],
    "rollout": ROLE_COLOURS[Role.TO_ROLLOUT],
}


# ---------------------------------------------------------------- numbers


def role_spans(roles: Sequence[RoleRecord], end_s: float) -> list[RoleSpan]:
    """Each cell's role spans: a role lasts until the cell's next role record.

    A cell's last role is closed at ``end_s`` (the run's end). Records of a cell are
    taken in time order (ties in file order); repeating the current role extends the
    span, and zero-length spans are dropped. Spans come out sorted by cell, then time.
    """
    by_cell: dict[int, list[RoleRecord]] = {}
    for record in roles:
        by_cell.setdefault(record.cell, []).append(record)
    spans: list[RoleSpan] = []
    for cell in sorted(by_cell):
        records = sorted(by_cell[cell], key=lambda r: r.time_s)  # stable: ties keep file order
        merged: list[RoleRecord] = []
        for record in records:
            if merged and merged[-1].role == record.role:
                continue  # same role again: the span goes on
            merged.append(record)
        for record, after in zip(merged, [*merged[1:], None], strict=True):
            stop = max(end_s, record.time_s) if after is None else after.time_s
            if stop > record.time_s:
                spans.append(RoleSpan(cell, Role(record.role), record.time_s, stop))
    return spans


def training_fractions(spans: Sequence[RoleSpan], cells: int, end_s: float) -> list[float]:
    """Each cell's fraction of ``[0, end_s]`` spent in the training role."""
    seconds = [0.0] * cells
    for span in spans:
        if span.role is Role.TRAINING and 0 <= span.cell < cells:
            seconds[span.cell] += span.end_s - span.start_s
    return [s / end_s if end_s > 0 else 0.0 for s in seconds]


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _fifth(n: int) -> int:
    """How many steps a fifth of ``n`` covers: at least one."""
    return max(1, round(n / 5)) if n else 0


@dataclass(kw_only=True, frozen=True)
class Summary:
    """The numbers in the report's summary table (NaN where nothing was recorded)."""

    steps: int
    wall_s: float
    seconds_per_step: float
    """The last step's end over the number of steps (the run's clock starts after any
    warm start, so this is the RL time per step)."""
    reward_first_fifth: float
    reward_last_fifth: float
    mean_staleness: float
    steady_staleness: float
    """Over the groups of the run's whole bursts (:func:`steady_steps`): what Eq 2 predicts."""
    execution_staleness: float
    """Step minus the version each trained execution launched with (top-ups launched
    after a publication used newer weights than their group's v_d)."""
    predicted_staleness: float
    mean_switch_s: dict[str, float] = field(default_factory=dict)
    """Mean measured switch seconds by direction (``training``, ``rollout``)."""
    switches: dict[str, int] = field(default_factory=dict)
    switch_engines: dict[str, str] = field(default_factory=dict)
    """By direction: how the engines freed their memory (SwitchRecord.engine), joined."""
    engine_backend: str = "embedded"
    mean_publication_s: float = math.nan
    """Mean seconds for a publication to reach every rollout engine."""
    publications: int = 0
    training_fraction: list[float] = field(default_factory=list)
    """Each cell's fraction of the wall time in the training role."""
    idle_fraction: list[float] = field(default_factory=list)
    """Each cell's fraction of its time idle (see :class:`UsageRecord`)."""
    steps_by_cells: dict[int, int] = field(default_factory=dict)
    """How many steps were trained by how many cells (satellites joining show here)."""
    no_signal_steps: list[int] = field(default_factory=list)
    """The steps with no learning signal (nothing packed: every advantage was zero)."""


def cell_count(metrics: RunMetrics) -> int:
    """K from the ``run`` record, or enough cells for every cell a record names."""
    named = [r.cell for r in metrics.roles] + [s.cell for s in metrics.switches]
    seen = max(named, default=-1) + 1
    return max(metrics.run.cells if metrics.run is not None else 0, seen)


def steady_staleness(metrics: RunMetrics) -> float:
    """Mean staleness of the groups trained in the run's whole bursts after the initial
    dispatch (:func:`~qwengyre.scheduler.staleness.steady_steps`), as the simulator
    measures it."""
    run = metrics.run
    if run is None:
        return math.nan
    steady = steady_steps(run.mu, run.phi, len(metrics.steps))
    return _mean([g.staleness for g in metrics.groups if g.step in steady])


def summarize(metrics: RunMetrics) -> Summary:
    """The summary table's numbers for ``metrics``."""
    end_s = metrics.end_s
    rewards = [s.reward_mean for s in metrics.steps]
    fifth = _fifth(len(rewards))
    run = metrics.run
    spans = role_spans(metrics.roles, end_s)
    cells = cell_count(metrics)
    return Summary(
        steps=len(metrics.steps),
        wall_s=end_s,
        seconds_per_step=metrics.steps[-1].time_s / len(metrics.steps)
        if metrics.steps
        else math.nan,
        reward_first_fifth=_mean(rewards[:fifth]),
        reward_last_fifth=_mean(rewards[-fifth:] if fifth else []),
        mean_staleness=_mean([g.staleness for g in metrics.groups]),
        steady_staleness=steady_staleness(metrics),
        execution_staleness=_mean([g.execution_staleness for g in metrics.groups]),
        predicted_staleness=run.predicted_staleness if run is not None else math.nan,
        mean_switch_s={
            d: _mean([s.seconds for s in metrics.switches if s.to == d]) for d in SWITCH_DIRECTIONS
        },
        switches={d: sum(1 for s in metrics.switches if s.to == d) for d in SWITCH_DIRECTIONS},
        switch_engines={
            d: ", ".join(sorted({s.engine for s in metrics.switches if s.to == d and s.engine}))
            for d in SWITCH_DIRECTIONS
        },
        engine_backend=run.engine_backend if run is not None else "embedded",
        mean_publication_s=_mean([p.seconds for p in metrics.publications]),
        publications=len(metrics.publications),
        training_fraction=training_fractions(spans, cells, end_s) if metrics.roles else [],
        idle_fraction=idle_fractions(metrics),
        steps_by_cells=dict(sorted(Counter(s.cells for s in metrics.steps).items())),
        no_signal_steps=[s.step for s in metrics.steps if not s.learning_signal],
    )


def _step_list(steps: Sequence[int], most: int = 12) -> str:
    shown = ", ".join(str(s) for s in steps[:most])
    return shown + (f", … ({len(steps) - most} more)" if len(steps) > most else "")


def learning_signal_warning(steps: Sequence[StepRecord]) -> str | None:
    """One line when a run learned nothing -- the reward never moved (two steps or more),
    or no step had a learning signal -- naming how many steps had none and what to
    check; None otherwise (some steps without a signal alone is no warning)."""
    if not steps:
        return None
    none = [s.step for s in steps if not s.learning_signal]
    rewards = [s.reward_mean for s in steps]
    still = len(steps) > 1 and max(rewards) == min(rewards)
    if not (still or len(none) == len(steps)):
        return None
    if still:
        head = f"the reward never moved ({rewards[0]:.3f} in all {len(steps)} steps)"
        head += f"; {len(none)} of {len(steps)} steps had no learning signal"
    else:
        head = f"no step had a learning signal (none of {len(steps)})"
    if none and len(none) < len(steps):
        head += f" (steps {_step_list(none)})"
    if none:
        head += (
            " -- nothing was packed: every group's rewards were equal, so every advantage"
            " was zero and the policy did not change"
        )
    return (
        f"{head}. Check that the starting policy scores neither always 0 nor always 1 on "
        "the tasks (the warm start: warm_start/warm_start.json and warm_start.accuracy, "
        "or model.path), that executions end with valid rewards (logs/, traces.jsonl), and "
        "the tasks' evaluator"
    )


def idle_fractions(metrics: RunMetrics) -> list[float]:
    """Each cell's idle share of its time, from its last ``usage`` record."""
    last = {u.cell: u for u in metrics.usage}
    return [last[c].idle_s / max(last[c].idle_s + last[c].busy_s, 1e-9) for c in sorted(last)]


# ---------------------------------------------------------------- figures


def _tidy(ax: object) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)  # type: ignore[attr-defined]


def reward_figure(steps: Sequence[StepRecord]) -> Figure:
    """Mean reward per step, with a band of ± one standard deviation."""
    fig = _new_figure()
    ax = fig.add_subplot()
    xs = [s.step for s in steps]
    mean = [s.reward_mean for s in steps]
    low = [s.reward_mean - s.reward_std for s in steps]
    high = [s.reward_mean + s.reward_std for s in steps]
    ax.fill_between(xs, low, high, color=RUNNING_COLOUR, alpha=0.2, linewidth=0, label="± std")
    ax.plot(xs, mean, color=RUNNING_COLOUR, linewidth=1.6, marker="o", markersize=3, label="mean")
    none = [s for s in steps if not s.learning_signal]
    if none:
        ax.scatter(
            [s.step for s in none],
            [s.reward_mean for s in none],
            color=NO_SIGNAL_COLOUR,
            marker="x",
            s=40,
            zorder=3,
            label=f"no learning signal ({len(none)} steps)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(axis="y", alpha=0.3)
    _tidy(ax)
    ax.set_title(f"Reward per step ({len(steps)} steps)")
    fig.legend(loc="outside lower center", ncol=3 if none else 2, frameon=False)
    return fig


TRAINING_PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("clipped_fraction", "clipped fraction"),
    ("grad_norm", "grad norm"),
    ("tokens_per_execution", "tokens per execution"),
    ("ratio_mean", "execution ratio s (mean)"),
    ("kl", "KL(behaviour ‖ current) per token"),
)


def training_figure(steps: Sequence[StepRecord]) -> Figure:
    """The optimizer's side of each step, one panel per :data:`TRAINING_PANELS` entry
    (a step with no learning signal trained nothing: it has no point)."""
    fig = _new_figure()
    trained = [s for s in steps if s.learning_signal]
    xs = [s.step for s in trained]
    for at, (name, label) in enumerate(TRAINING_PANELS, start=1):
        ax = fig.add_subplot(3, 2, at)
        if name == "tokens_per_execution":
            ys = [s.tokens / s.rewards if s.rewards else math.nan for s in trained]
        else:
            ys = [float(getattr(s, name)) for s in trained]
        ax.plot(xs, ys, color=RUNNING_COLOUR, linewidth=1.2, marker="o", markersize=2)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        _tidy(ax)
    fig.suptitle(f"Training per step ({len(trained)} steps that trained)")
    return fig


def staleness_figure(groups: Sequence[GroupRecord], predicted: float) -> Figure:
    """Histogram of the trained groups' staleness, Eq 2's prediction as a vertical line."""
    fig = _new_figure()
    ax = fig.add_subplot()
    values = [g.staleness for g in groups]
    low, high = min(values), max(values)
    bins = [b - 0.5 for b in range(low, high + 2)]
    ax.hist(values, bins=bins, color=RUNNING_COLOUR, edgecolor="white", label="groups")
    measured = _mean(values)
    ax.axvline(measured, color=QUEUED_COLOUR, linewidth=1.6, label=f"measured {measured:.2f}")
    if math.isfinite(predicted):
        ax.axvline(
            predicted,
            color=PREDICTION_COLOUR,
            linestyle="--",
            linewidth=1.6,
            label=f"Eq 2 prediction {predicted:.2f}",
        )
    ax.set_xticks(range(low, high + 1))
    shown = [low - 0.5, high + 0.5, *([predicted] if math.isfinite(predicted) else [])]
    ax.set_xlim(min(shown) - 0.1, max(shown) + 0.1)
    ax.set_xlabel("staleness (policy versions)")
    ax.set_ylabel("groups")
    ax.grid(axis="y", alpha=0.3)
    _tidy(ax)
    pred = f" (Eq 2 predicts {predicted:.2f})" if math.isfinite(predicted) else ""
    ax.set_title(f"Staleness of {len(values)} trained groups: mean {measured:.2f}{pred}")
    fig.legend(loc="outside lower center", ncol=3, frameon=False)
    return fig


def switch_figure(switches: Sequence[SwitchRecord]) -> Figure:
    """Each switch's measured seconds at the time it finished, one colour per direction."""
    fig = _new_figure()
    ax = fig.add_subplot()
    unit = time_unit(max(s.time_s for s in switches))
    for direction in SWITCH_DIRECTIONS:
        chosen = [s for s in switches if s.to == direction]
        if not chosen:
            continue
        ax.scatter(
            [unit.of(s.time_s) for s in chosen],
            [s.seconds for s in chosen],
            color=SWITCH_COLOURS[direction],
            s=24,
            label=f"to {direction}: mean {_mean([s.seconds for s in chosen]):.2f} s",
            zorder=3,
        )
    ax.set_xlabel(unit.label)
    ax.set_ylabel("switch duration (s)")
    ax.set_ylim(bottom=0.0)
    ax.grid(axis="y", alpha=0.3)
    _tidy(ax)
    ax.set_title(f"Cell switches ({len(switches)})")
    fig.legend(loc="outside lower center", ncol=2, frameon=False)
    return fig


# ---------------------------------------------------------------- page


def _num(value: float, digits: int = 3, unit: str = "") -> str:
    if not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}{unit}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "–"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h ({seconds:.0f} s)"
    return f"{seconds:.1f} s"


def _rows(summary: Summary) -> list[tuple[str, str]]:
    rows = [
        ("steps", str(summary.steps)),
        ("wall time", _duration(summary.wall_s)),
        ("time per step", _duration(summary.seconds_per_step)),
        ("mean reward, first fifth of steps", _num(summary.reward_first_fifth)),
        ("mean reward, last fifth of steps", _num(summary.reward_last_fifth)),
        ("mean staleness (measured)", _num(summary.mean_staleness)),
        ("mean staleness, steady state (measured)", _num(summary.steady_staleness)),
        (
            "mean staleness of the versions executions launched with",
            _num(summary.execution_staleness),
        ),
        ("mean staleness (Eq 2 prediction)", _num(summary.predicted_staleness)),
    ]
    for direction in SWITCH_DIRECTIONS:
        count = summary.switches.get(direction, 0)
        mean = summary.mean_switch_s.get(direction, math.nan)
        how = summary.switch_engines.get(direction)
        detail = f"{count} switches" + (f"; engine memory {how}" if how else "")
        rows.append((f"mean switch time to {direction}", f"{_num(mean, 2, ' s')} ({detail})"))
    rows.append(
        (
            f"mean publication time ({summary.engine_backend} engines)",
            f"{_num(summary.mean_publication_s, 2, ' s')} ({summary.publications} publications)",
        )
    )
    if summary.steps:
        none = summary.no_signal_steps
        rows.append(
            (
                "steps with no learning signal",
                f"{len(none)} of {summary.steps}"
                + (f" (steps {_step_list(none)})" if 0 < len(none) < summary.steps else ""),
            )
        )
    if summary.steps_by_cells:
        rows.append(
            (
                "cells training a step",
                ", ".join(f"{k}: {n} steps" for k, n in summary.steps_by_cells.items()),
            )
        )
    for cell, share in enumerate(summary.training_fraction):
        name = "cell 0 (core)" if cell == 0 else f"cell {cell}"
        rows.append((f"{name}: time in training", f"{share:.1%}"))
    for cell, share in enumerate(summary.idle_fraction):
        rows.append((f"cell {cell}: idle", f"{share:.1%}"))
    return rows


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1250px; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 1em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; }
p.none { color: #777; font-style: italic; }
p.warning { background: #fdecea; border-left: 4px solid #d62728; padding: 0.6em 1em; }
"""


@dataclass
class _Section:
    title: str
    image: str | None = None
    note: str = ""
    table: list[tuple[str, str]] | None = None


def assessment_rows(records: Sequence[AssessmentRecord]) -> list[tuple[str, str]]:
    """The assessments table: what the evaluators said about the run's executions
    (``assessments.jsonl``), final attempts, placeholders and intermediate ones apart."""
    executions = {r.execution_id for r in records}
    final = [r.assessment for r in records if r.assessment.kind == "final"]
    by_execution: dict[str, list[Assessment]] = {}
    for r in records:
        if r.assessment.kind == "final":
            by_execution.setdefault(r.execution_id, []).append(r.assessment)
    resolved = sum(1 for attempts in by_execution.values() if any(a.valid for a in attempts))
    retried = sum(1 for attempts in by_execution.values() if len(attempts) > 1)
    intermediate = [r for r in records if r.assessment.kind == "intermediate"]
    return [
        ("executions with an assessment", str(len(executions))),
        ("evaluated: a valid reward", f"{resolved} of {len(by_execution)}"),
        ("evaluated: no valid reward (not trained)", str(len(by_execution) - resolved)),
        ("evaluation attempts (retried executions)", f"{len(final)} ({retried})"),
        (
            "infrastructure failures (zero-reward placeholder)",
            str(sum(1 for r in records if r.assessment.kind == "placeholder")),
        ),
        (
            "intermediate assessments (artifact versions)",
            f"{len(intermediate)}"
            f" ({len({(r.execution_id, r.assessment.version) for r in intermediate})})",
        ),
    ]


def _page(
    title: str,
    subtitle: str,
    summary: Summary,
    sections: Sequence[_Section],
    warning: str | None = None,
) -> str:
    e = html.escape
    rows = "\n".join(
        f"<tr><th>{e(name)}</th><td class='num'>{e(value)}</td></tr>"
        for name, value in _rows(summary)
    )
    parts = [
        "<!DOCTYPE html>",
        "<html lang='en'>",
        "<head>",
        "<meta charset='utf-8'>",
        f"<title>{e(title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        f"<h1>{e(title)}</h1>",
        f"<p>{e(subtitle)}</p>",
        *(
            [f"<p class='warning' id='no-learning-signal'>Warning: {e(warning)}.</p>"]
            if warning
            else []
        ),
        "<h2>Summary</h2>",
        f"<table id='summary'>\n{rows}\n</table>",
    ]
    for section in sections:
        parts.append(f"<h2>{e(section.title)}</h2>")
        if section.table is not None:
            table = "\n".join(
                f"<tr><th>{e(name)}</th><td class='num'>{e(value)}</td></tr>"
                for name, value in section.table
            )
            parts.append(f"<table>\n{table}\n</table>")
        elif section.image is not None:
            parts.append(f"<img src='{e(section.image)}' alt='{e(section.title)}'>")
        else:
            parts.append(f"<p class='none'>{e(section.note)}</p>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def describe_policy(metrics: RunMetrics) -> str:
    """``elastic (μ=2, φ=0.5)``, or ``?`` when the run's shape was not recorded."""
    run = metrics.run
    return "?" if run is None else f"{run.policy} (μ={run.mu}, φ={run.phi:g})"


def _describe(metrics: RunMetrics) -> str:
    run = metrics.run
    if run is None:
        return "run shape not recorded"
    pool = f", standalone pool C_s={run.standalone_capacity}" if run.standalone_capacity else ""
    streaming = "streaming" if run.streaming else "non-streaming"
    return (
        f"policy {describe_policy(metrics)}, {run.dispatch} dispatch, {streaming},"
        f" K={run.cells} cells{pool},"
        f" batch {run.batch} groups of {run.group_size}"
    )


def read_run(run_dir: Path) -> RunMetrics:
    """The metrics of ``run_dir``.

    Raises ``FileNotFoundError`` when ``run_dir`` or its ``metrics.jsonl`` is missing and
    :class:`~qwengyre.records.metrics.MetricsError` for an unreadable log.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    log = run_dir / METRICS_FILE
    if not log.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    return read_metrics(log)


def write_report(
    run_dir: Path, out_dir: Path | None = None, *, metrics: RunMetrics | None = None
) -> Path:
    """Write the report of ``run_dir`` (default into ``run_dir/report``); return index.html.

    ``metrics`` are the run's when the caller has read them already; otherwise they are
    read here, raising as :func:`read_run` does.
    """
    run_dir = Path(run_dir)
    if metrics is None:
        metrics = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(metrics)
    end_s = max(metrics.end_s, 1.0)
    describe = _describe(metrics)
    run = metrics.run
    sections: list[_Section] = []

    def figure(title: str, name: str, fig: Figure | None, none: str) -> None:
        if fig is None:
            stale = out / name
            stale.unlink(missing_ok=True)  # a figure from an earlier report no longer applies
            sections.append(_Section(title, note=none))
        else:
            _save(fig, out / name)
            sections.append(_Section(title, image=name))

    figure(
        "Reward",
        "reward.png",
        reward_figure(metrics.steps) if metrics.steps else None,
        "No steps recorded.",
    )
    figure(
        "Training",
        "training.png",
        training_figure(metrics.steps) if any(s.learning_signal for s in metrics.steps) else None,
        "No step trained anything.",
    )
    spans = role_spans(metrics.roles, metrics.end_s)
    figure(
        "Cell roles",
        "timeline.png",
        spans_timeline_figure(
            spans,
            end_s=end_s,
            cells=max(cell_count(metrics), 1),
            step_end_s=[s.time_s for s in metrics.steps],
            title=f"Cell roles — {describe}: {summary.steps} steps in {_duration(end_s)}",
            standalone_capacity=metrics.run.standalone_capacity if metrics.run else 0,
        )
        if spans
        else None,
        "No role changes recorded.",
    )
    samples = [LoadSample(r.time_s, r.running, r.queued, r.capacity) for r in metrics.loads]
    figure(
        "Rollout load",
        "load.png",
        samples_load_figure(samples, end_s=end_s, title=f"Rollout load — {describe}")
        if samples
        else None,
        "No load samples recorded.",
    )
    figure(
        "Staleness",
        "staleness.png",
        staleness_figure(metrics.groups, run.predicted_staleness if run else math.nan)
        if metrics.groups
        else None,
        "No trained groups recorded.",
    )
    figure(
        "Switch times",
        "switches.png",
        switch_figure(metrics.switches) if metrics.switches else None,
        "No switches recorded (an async run never switches cells).",
    )
    assessments = read_assessments(run_dir / ASSESSMENTS_FILE)
    sections.append(
        _Section("Assessments", table=assessment_rows(assessments))
        if assessments
        else _Section("Assessments", note=f"No {ASSESSMENTS_FILE} in the run directory.")
    )
    index = out / INDEX_FILE
    title = f"qwengyre run report: {run_dir.resolve().name}"
    warning = learning_signal_warning(metrics.steps)
    index.write_text(_page(title, describe, summary, sections, warning), encoding="utf-8")
    return index
