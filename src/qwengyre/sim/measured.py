"""A live run's own costs, from its metrics log, as the simulator's cost settings.

``qwengyre plan --trace RUN_DIR`` replays the run's executions. Charging them the
simulator's default costs (paper-122b's calibration: 30 s publications, 10k tokens/s a
cell) would rank shapes for a machine the run never ran on, so the costs come from the
run's ``metrics.jsonl`` instead:

- ``cells.rollout_to_training_s`` / ``cells.training_to_rollout_s``: the mean switch
  time each way (``switch`` records);
- ``sim.publish_s``: the mean publication time (``publication`` records);
- ``sim.train_tokens_per_cell_s``: tokens trained over the seconds cells spent in
  micro-steps, summed over every step (``step`` records' ``tokens``/``micro_step_s``);
- ``sim.train_step_overhead_s``: the mean time from the last micro-step to the update
  done (``update_s``);
- ``sim.micro_step_tokens``: the run's own micro-step budget
  (``trainer.micro_step_tokens``), so that a step is cut as the run cut it.

Means, not medians: a simulated run's time is a sum of these costs, and the mean is
what keeps that sum. A cost the log holds no record of (an Async run never switches;
logs written before ``micro_step_s`` existed) keeps the config's value, and
:func:`measured_costs` says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from qwengyre.config import Config
from qwengyre.records.metrics import RunMetrics


@dataclass(frozen=True)
class Measured:
    """``key`` (a dotted config key) set to ``value``, measured over ``samples`` records
    as ``basis`` says (0 samples: taken from the run's config, not measured)."""

    key: str
    value: float
    samples: int
    basis: str

    def describe(self) -> str:
        return f"{self.key} = {self.value:.4g} ({self.basis})"


def measured_costs(metrics: RunMetrics, config: Config) -> tuple[list[Measured], list[str]]:
    """The simulator's costs measured in ``metrics`` (a run of ``config``), and the keys
    the log holds nothing for (they keep ``config``'s value)."""
    tokens = config.trainer.micro_step_tokens
    found = [Measured("sim.micro_step_tokens", tokens, 0, "the run's trainer.micro_step_tokens")]
    missing: list[str] = []

    def mean(key: str, values: list[float], records: str) -> None:
        if values:
            basis = f"mean over {len(values)} {records}"
            found.append(Measured(key, statistics.fmean(values), len(values), basis))
        else:
            missing.append(key)

    for key, to in (
        ("cells.rollout_to_training_s", "training"),
        ("cells.training_to_rollout_s", "rollout"),
    ):
        mean(key, [s.seconds for s in metrics.switches if s.to == to], f"switch(es) to {to}")
    mean("sim.publish_s", [p.seconds for p in metrics.publications], "publication(s)")
    timed = [s for s in metrics.steps if math.isfinite(s.micro_step_s) and s.micro_step_s > 0]
    if timed and (trained := sum(s.tokens for s in timed)) > 0:
        rate = trained / sum(s.micro_step_s for s in timed)
        basis = f"tokens over micro-step seconds in {len(timed)} steps"
        found.append(Measured("sim.train_tokens_per_cell_s", rate, len(timed), basis))
    else:
        missing.append("sim.train_tokens_per_cell_s")
    updates = [s.update_s for s in metrics.steps if math.isfinite(s.update_s)]
    mean("sim.train_step_overhead_s", updates, "step update(s)")
    return found, missing


def with_costs(config: Config, costs: list[Measured]) -> Config:
    """``config`` with each of ``costs`` set (a new, validated :class:`Config`)."""
    data = config.model_dump()
    for cost in costs:
        section, name = cost.key.split(".")
        value = round(cost.value) if name == "micro_step_tokens" else cost.value
        data[section][name] = value
    return Config.model_validate(data)
