"""The scheduler's parameters and the simulator's costs for tests: the config tree's
defaults (the one place they are declared) with a test's overrides."""

from __future__ import annotations

import dataclasses
from typing import Any

from qwengyre.config import load_config
from qwengyre.scheduler.core import SchedulerParams
from qwengyre.sim.simulator import SimCosts

DEFAULTS = load_config(None, [])


def make_params(**overrides: Any) -> SchedulerParams:
    """The default config's scheduler parameters with ``overrides`` (validated as any
    SchedulerParams is)."""
    return dataclasses.replace(DEFAULTS.scheduler_params(), **overrides)


def make_costs(**overrides: Any) -> SimCosts:
    """The default config's simulator costs with ``overrides``."""
    return dataclasses.replace(SimCosts.from_config(DEFAULTS), **overrides)
