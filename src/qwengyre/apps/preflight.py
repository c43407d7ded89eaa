"""Preflight: what a run needs that can be checked in seconds, checked before anything
expensive starts (the warm start, the cells, the engines, Ray).

Each check that fails raises :class:`PreflightError` (a ``ValueError``: the command line
prints it as one ``qwengyre: error: ...`` line, exit code 2) naming what is wrong and
the fix. :func:`preflight` returns what the checks built, so the run uses exactly what
was checked: the task set, the harness, its sandbox.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qwengyre.cluster.devices import require_device
from qwengyre.config import Config, HarnessConfig
from qwengyre.engines.factory import server_backend
from qwengyre.report.sinks import check_metrics
from qwengyre.rollout.environments import EnvironmentOptions
from qwengyre.rollout.harness import HarnessSpec, harness_spec
from qwengyre.rollout.limits import Limits
from qwengyre.rollout.sandbox import sandbox, warn_on_stderr
from qwengyre.rollout.tasks import Task
from qwengyre.rollout.workloads import load_task_source

__all__ = ["Preflight", "PreflightError", "load_task_set", "preflight", "require_program"]


class PreflightError(ValueError):
    """Something a run needs is missing or wrong; the message names the fix."""


@dataclass(frozen=True)
class Preflight:
    """What the checks built: the tasks, the harness (confined and bounded)."""

    tasks: list[Task]
    harness: HarnessSpec  # its sandbox: the one checked


def load_task_set(config: Config) -> list[Task]:
    """``harness.tasks``'s tasks -- a task JSONL or ``FORMAT:PATH`` of a workload format
    (:func:`~qwengyre.rollout.workloads.load_task_source`; errors name the file, line and
    field) -- else the bundled toy task set."""
    if config.harness.tasks is not None:
        return load_task_source(config.harness.tasks)
    from qwengyre.rollout.toy_tasks import rl_tasks

    return rl_tasks()


def require_program(spec: HarnessSpec, name: str) -> None:
    """The harness's program exists: an executable path, or a name on the PATH the
    harness inherits (a program given by a template placeholder is not checked)."""
    program = spec.command[0]
    if "{" in program:
        return
    found = shutil.which(program, path=spec.env.get("PATH"))
    if found is None:
        hints = {
            "claude": "npm install -g @anthropic-ai/claude-code, or set QWENGYRE_CLAUDE_BIN",
            "qwen": "npm install -g @qwen-code/qwen-code, or set QWENGYRE_QWEN_BIN",
            "opencode": "npm install -g opencode-ai, or set QWENGYRE_OPENCODE_BIN",
            "codex": "npm install -g @openai/codex, or set QWENGYRE_CODEX_BIN",
            "mini": "pip install mini-swe-agent",
        }
        hint = hints.get(Path(program).name, "install it, or give its full path in harness.name")
        raise PreflightError(f"harness {name!r} needs {program!r}, which is not found: {hint}")


def checked_harness(
    harness: HarnessConfig, *, warn: Callable[[str], None] = warn_on_stderr
) -> HarnessSpec:
    """The harness ``harness.name`` names, confined by the sandbox ``harness`` asks for
    (checked to run here: :class:`~qwengyre.rollout.sandbox.SandboxUnavailable`
    otherwise), bounded by its limits, its tasks' environments prepared as it says;
    :class:`PreflightError` if its program is not installed."""
    confine = sandbox(harness.sandbox, harness.sandbox_hide, harness.sandbox_expose, warn=warn)
    confine.check()
    spec = harness_spec(
        harness.name,
        harness.deadline_s,
        confine,
        Limits.of(harness.limits),
        EnvironmentOptions.of(harness),
    )
    require_program(spec, harness.name)
    return spec


def preflight(config: Config, *, warn: Callable[[str], None]) -> Preflight:
    """Check what ``qwengyre train`` with ``config`` needs (see the module docstring):
    metric sinks, tasks, harness program, sandbox, engine backend, devices, Ray."""
    check_metrics(config)
    tasks = load_task_set(config)
    if not tasks:
        raise PreflightError(f"{config.harness.tasks}: no tasks to train on")
    h = config.harness
    spec = checked_harness(h, warn=warn)
    if config.engine.backend != "embedded":
        server_backend(config.engine.backend).require_installed()
    if config.run.placement == "local":  # under Ray the GPUs may be on other nodes
        require_device(config.run.device)
    if config.run.placement == "ray" or h.hosts == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise PreflightError(
                "run.placement=ray / harness.hosts=ray need Ray: pip install 'qwengyre[ray]'"
            ) from None
    if h.hosts == "ray" and config.run.placement != "ray":
        from qwengyre.cluster.ray_harness import require_ray

        require_ray()  # run.placement=ray starts Ray later
    return Preflight(tasks=tasks, harness=spec)
