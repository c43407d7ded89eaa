"""One execution end to end: workspace, harness, evaluation, outcome (issue 6, lifecycle).

Two budgets, both from the execution's launch:

- the *harness deadline*: the harness is stopped (its whole process group) and its work
  is still evaluated — outcome ``harness_timeout`` with a reward;
- the *overall budget*: evaluation retries included; if it ends before a valid
  assessment exists the outcome is ``overall_timeout`` and the execution has no reward
  (it is excluded from training, never scored 0).

A workspace that never comes up (the template cannot be copied, the setup command
fails) leaves nothing assessable: outcome ``failed`` with the zero-reward placeholder.
An evaluation that gives up before the overall budget ends (every attempt invalid)
is ``failed`` with no reward. A cancelled execution (surplus under oversampling) is
``cancelled``, not evaluated. Every execution ends with exactly one outcome.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from qwengyre.rollout.evaluation import Assessment, assess, final, placeholder
from qwengyre.rollout.harness import HarnessRun, HarnessSpec, run_harness
from qwengyre.rollout.tasks import Task
from qwengyre.types import Outcome


@dataclass(frozen=True)
class Budgets:
    """Seconds from launch: the harness deadline and the overall budget."""

    harness_s: float
    overall_s: float

    def __post_init__(self) -> None:
        if not 0 < self.harness_s <= self.overall_s:
            raise ValueError(
                f"budgets must satisfy 0 < harness_s ({self.harness_s}) <= overall_s"
                f" ({self.overall_s})"
            )


@dataclass(frozen=True)
class ExecutionResult:
    """How one execution ended; ``reward`` is None exactly when no valid assessment exists."""

    execution_id: str
    task_id: str
    outcome: Outcome
    reward: float | None
    started_s: float  # time.monotonic()
    ended_s: float
    harness: HarnessRun | None
    assessments: tuple[Assessment, ...] = field(default=())
    detail: str = ""


async def _prepare_workspace(task: Task, workspace: Path, timeout_s: float) -> str | None:
    """Create the workspace; the reason it could not be created, or None."""
    try:
        if task.workspace_template is not None:
            shutil.copytree(task.workspace_template, workspace, symlinks=True)
            return None
        workspace.mkdir(parents=True)
        if task.setup is None:
            return None
        proc = await asyncio.create_subprocess_shell(
            task.setup,
            cwd=workspace,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return f"setup did not finish within {timeout_s:.0f} s"
        if proc.returncode != 0:
            return f"setup exited with {proc.returncode}: {stderr.decode(errors='replace')[-300:]}"
        return None
    except OSError as exc:
        return f"workspace could not be created: {exc}"


async def run_execution(
    task: Task,
    harness: HarnessSpec,
    budgets: Budgets,
    *,
    execution_id: str,
    run_dir: Path,
    base_url: str,
    api_key: str,
    cancel: asyncio.Event | None = None,
    evaluation_attempts: int = 5,
    retry_delay_s: float = 1.0,
) -> ExecutionResult:
    """Run ``task`` once with ``harness``; workspaces and logs go under ``run_dir``."""
    started = time.monotonic()
    overall_deadline = started + budgets.overall_s
    workspace = run_dir / "workspaces" / execution_id
    logs = run_dir / "logs" / execution_id

    def result(
        outcome: Outcome,
        reward: float | None,
        harness_run: HarnessRun | None,
        assessments: tuple[Assessment, ...] = (),
        detail: str = "",
    ) -> ExecutionResult:
        ended = time.monotonic()
        return ExecutionResult(
            execution_id,
            task.id,
            outcome,
            reward,
            started,
            ended,
            harness_run,
            assessments,
            detail,
        )

    problem = await _prepare_workspace(task, workspace, budgets.harness_s)
    if problem is not None:
        nothing = placeholder(problem)
        return result(Outcome.FAILED, 0.0, None, (nothing,), problem)
    logs.mkdir(parents=True, exist_ok=True)
    run = await run_harness(
        replace(harness, deadline_s=budgets.harness_s),
        workspace=workspace,
        logs_dir=logs,
        execution_id=execution_id,
        base_url=base_url,
        api_key=api_key,
        instructions=task.instructions,
        cancel=cancel,
    )
    if run.cancelled:
        return result(Outcome.CANCELLED, None, run, detail="cancelled")
    if run.timed_out:
        outcome = Outcome.HARNESS_TIMEOUT
    elif run.exit_code == 0 and run.error is None:
        outcome = Outcome.COMPLETED
    else:
        outcome = Outcome.FAILED
    attempts = tuple(
        await assess(
            task.evaluator,
            workspace,
            deadline=overall_deadline,
            max_attempts=evaluation_attempts,
            retry_delay_s=retry_delay_s,
            metadata=dict(task.metadata),
        )
    )
    valid = final(attempts)
    if valid is not None:
        return result(outcome, valid.score, run, attempts)
    if time.monotonic() >= overall_deadline:
        ended = "the overall budget ended before a valid assessment"
        return result(Outcome.OVERALL_TIMEOUT, None, run, attempts, ended)
    return result(Outcome.FAILED, None, run, attempts, "every evaluation attempt was invalid")
