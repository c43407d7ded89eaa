"""One execution end to end: workspace, harness, evaluation, outcome (the execution lifecycle).

Two budgets, both from the execution's launch (after its task's environment, if it
names one, was prepared: :mod:`qwengyre.rollout.environments`; the harness and the
command evaluator then run in it):

- the *harness deadline*: the harness is stopped (its whole process group) and its work
  is still evaluated — outcome ``harness_timeout`` with a reward;
- the *overall budget*: evaluation retries included (retried until a valid attempt or
  the budget's end, :func:`~qwengyre.rollout.evaluation.assess`); if it ends before a
  valid assessment exists the outcome is ``overall_timeout`` and the execution has no
  reward (it is excluded from training, never scored 0).

Complete failures that leave nothing assessable get outcome ``failed`` with the
zero-reward :func:`~qwengyre.rollout.evaluation.placeholder`, its reason in ``detail``:

- the task's environment cannot be prepared (:mod:`qwengyre.rollout.environments`: a
  missing root or archive, one that does not unpack, a root without ``/bin/sh``, an
  image that cannot be pulled, ``harness.environment_timeout_s`` passed);
- the workspace never comes up (the template cannot be copied, the setup command fails);
- an *infrastructure failure* of the harness (:func:`infrastructure_failure`): it could
  not be spawned, or it exited non-zero by itself without having touched the workspace
  or called the model.

An evaluation that gives up before the overall budget ends (the workspace changed
under a retry, or the optional attempt cap) is ``failed`` with no reward. A cancelled
execution (surplus under oversampling) is ``cancelled``, not evaluated. Every execution
ends with exactly one outcome.

Every assessment is kept in :attr:`ExecutionResult.assessments`, in the order made:
intermediate ones (made while the harness ran, :mod:`qwengyre.rollout.assessments`),
then the final attempts or the placeholder. Only the final assessment gives the reward.
With a ``hub`` (the proxy), the execution registers its intermediate assessor for the
proxy's ``POST /x/{execution_id}/assess`` while its harness runs, and the proxy's record
of its model calls informs :func:`infrastructure_failure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qwengyre.config import EvaluationConfig
from qwengyre.records.assessments import Assessment
from qwengyre.records.trace import TraceCall, TraceRecord
from qwengyre.rollout.assessments import ArtifactVersions, AssessmentHub, IntermediateAssessor
from qwengyre.rollout.environments import EnvironmentUnavailable, prepare_environment
from qwengyre.rollout.evaluation import (
    artifact_digest,
    assess,
    final,
    placeholder,
)
from qwengyre.rollout.harness import (
    HarnessRun,
    HarnessRunner,
    HarnessSpec,
    prepare_harness,
    supervise,
)
from qwengyre.rollout.sandbox import Sandbox
from qwengyre.rollout.tasks import Task
from qwengyre.types import Outcome

log = logging.getLogger(__name__)


LAUNCH_FILE = "launch.json"
"""In an execution's logs: when it was launched and its workspace's digest after setup,
what evaluating an adopted execution needs (:func:`run_execution`)."""


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


@dataclass(kw_only=True, frozen=True)
class ExecutionResult:
    """How one execution ended; ``reward`` is None exactly when no valid assessment exists.

    ``assessments``: every assessment of the execution, in the order made (intermediate,
    then final attempts or the placeholder); write them with
    :class:`~qwengyre.rollout.assessments.AssessmentLog`. ``host``: the name of the
    harness host that ran it (:mod:`qwengyre.rollout.hosts`; empty when none did).
    """

    execution_id: str
    task_id: str
    outcome: Outcome
    reward: float | None
    started_s: float  # time.monotonic()
    ended_s: float
    harness: HarnessRun | None
    assessments: tuple[Assessment, ...] = field(default=())
    detail: str = ""
    host: str = ""


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


def infrastructure_failure(
    run: HarnessRun,
    setup_digest: str,
    after_digest: str | None,
    model_calls: int | None,
) -> str | None:
    """Why ``run`` is an infrastructure failure (the harness never really ran), or None.

    It is one exactly when either

    1. the harness process could not be spawned (:attr:`HarnessRun.spawned` is False:
       missing binary, exec failure, a working directory that vanished); or
    2. it ended by itself -- not timed out, not cancelled -- with a non-zero status (or
       a signal) *and* the workspace digest after it (``after_digest``) equals the one
       taken right after setup (``setup_digest``) *and* it made no model call
       (``model_calls == 0``, from the proxy's records).

    Without the proxy's records (``model_calls is None``: no hub was given) rule 2 rests
    on the exit status and the digest alone. The model-call condition is what separates
    a crash at start-up from a policy that talked for an hour, touched nothing and then
    made its harness fail: the latter's trajectories are the policy's own doing, so its
    untouched workspace is evaluated like any other result. Not infrastructure failures,
    and so evaluated: a harness that exited 0 (even having changed nothing), one that
    changed the workspace or called the model before crashing, and a harness timeout.
    """
    if not run.spawned:
        return f"infrastructure failure: {run.error or 'the harness could not be spawned'}"
    if run.timed_out or run.cancelled or run.exit_code == 0:
        return None
    if after_digest is None or after_digest != setup_digest or model_calls not in (0, None):
        return None
    status = "raised" if run.exit_code is None else f"exited with status {run.exit_code}"
    calls = "" if model_calls is None else " and made no model call"
    reason = f" ({run.error})" if run.error else ""
    return (
        f"infrastructure failure: the harness {status}{reason} without touching the "
        f"workspace{calls}"
    )


async def _environment(
    task: Task, harness: HarnessSpec, run_dir: Path
) -> tuple[Sandbox | None, str | None]:
    """The sandbox of the task's environment (None: the task has none), or why it
    could not be prepared (:func:`~qwengyre.rollout.environments.prepare_environment`)."""
    if task.environment is None:
        return None, None
    options = harness.environment
    try:
        prepared = await prepare_environment(task.environment, options, options.cache_dir(run_dir))
    except EnvironmentUnavailable as error:
        return None, str(error)
    return prepared, None


async def _digest(workspace: Path) -> str | None:
    try:
        return await asyncio.to_thread(artifact_digest, workspace)
    except OSError:
        return None


async def _model_calls(hub: AssessmentHub | None, execution_id: str) -> int | None:
    """How many model calls the proxy recorded for the execution (None: unknown).

    Only the length of the tree's ``nodes`` is read, so a hub away from the proxy can
    answer with the admin API's JSON tree (:mod:`qwengyre.cluster.ray_harness`)."""
    if hub is None:
        return None
    try:
        return len((await hub.tree(execution_id)).nodes)
    except Exception:  # an unknown execution, a damaged store: not known
        log.warning("cannot count the model calls of %s", execution_id, exc_info=True)
        return None


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
    evaluation: EvaluationConfig | None = None,
    hub: AssessmentHub | None = None,
    runner: HarnessRunner = supervise,
    adopt: Callable[[asyncio.Event | None], Awaitable[HarnessRun]] | None = None,
) -> ExecutionResult:
    """Run ``task`` once with ``harness``; workspaces and logs go under ``run_dir``.

    ``runner`` starts the harness and waits for it (in this process by default, or
    under a harness daemon: :mod:`qwengyre.rollout.harnessd`). ``adopt``: the execution
    was launched by a controller that died and its harness may still run; nothing is
    prepared or started, ``adopt`` waits for that harness (``cancel`` kills it) and the
    execution is evaluated as if it had been run here, its budgets counted from its
    first launch (:data:`LAUNCH_FILE`).

    ``evaluation`` (the config's ``evaluation`` section) sets the retry pacing, the
    optional attempt cap and the intermediate schedule (default: retries until the overall
    budget, no schedule). ``hub`` (the proxy serving ``base_url``, or a stand-in for it on the
    harness's node; its ``execution_id`` must be this one) receives the intermediate
    assessor while the harness runs and is asked for the model-call count
    (:func:`infrastructure_failure`, :func:`_model_calls`).

    A task naming an environment has it prepared first, as ``harness.environment``
    says (:func:`~qwengyre.rollout.environments.prepare_environment`); its sandbox then
    confines the harness in place of ``harness.sandbox`` and runs a command evaluator,
    and a preparation that fails ends the execution with the zero-reward placeholder.
    """
    options = evaluation or EvaluationConfig()
    workspace = run_dir / "workspaces" / execution_id
    logs = run_dir / "logs" / execution_id
    confine, unprepared = await _environment(task, harness, run_dir)
    started = time.monotonic()
    if adopt is not None:
        launched = json.loads((logs / LAUNCH_FILE).read_text())
        started -= time.time() - launched["time"]
        setup_digest: str | None = launched["setup_digest"]
    overall_deadline = started + budgets.overall_s

    def result(
        outcome: Outcome,
        reward: float | None,
        harness_run: HarnessRun | None,
        assessments: tuple[Assessment, ...] = (),
        detail: str = "",
    ) -> ExecutionResult:
        ended = time.monotonic()
        return ExecutionResult(
            execution_id=execution_id,
            task_id=task.id,
            outcome=outcome,
            reward=reward,
            started_s=started,
            ended_s=ended,
            harness=harness_run,
            assessments=assessments,
            detail=detail,
        )

    if unprepared is not None:  # never leave an adopted harness behind
        left = await adopt(cancel) if adopt is not None else None
        return result(Outcome.FAILED, 0.0, left, (placeholder(unprepared),), unprepared)
    if adopt is None:
        problem = await _prepare_workspace(task, workspace, budgets.harness_s)
        setup_digest = await _digest(workspace) if problem is None else None
        if problem is not None or setup_digest is None:
            problem = problem or "the workspace cannot be read after setup"
            return result(Outcome.FAILED, 0.0, None, (placeholder(problem),), problem)
        logs.mkdir(parents=True, exist_ok=True)
        launched_at = time.time() - (time.monotonic() - started)
        launched = {"time": launched_at, "setup_digest": setup_digest}
        (logs / LAUNCH_FILE).write_text(json.dumps(launched))
    assert setup_digest is not None
    versions = ArtifactVersions()
    intermediate = IntermediateAssessor(
        task.evaluator,
        workspace,
        deadline=overall_deadline,
        versions=versions,
        metadata=dict(task.metadata),
        sandbox=confine,
    )
    if hub is not None:
        hub.register_assessor(execution_id, intermediate.answer)
    schedule: asyncio.Future[None] | None = None
    if options.intermediate_every_s is not None:
        schedule = asyncio.ensure_future(intermediate.periodic(options.intermediate_every_s))
    try:
        if adopt is not None:
            run = await adopt(cancel)
        else:
            launch = prepare_harness(
                replace(harness, deadline_s=budgets.harness_s, sandbox=confine or harness.sandbox),
                workspace=workspace,
                logs_dir=logs,
                execution_id=execution_id,
                base_url=base_url,
                api_key=api_key,
                instructions=task.instructions,
                hidden=(run_dir, run_dir.parent),  # this run and its sibling runs
            )
            run = await runner(launch, cancel)
    finally:
        if hub is not None:
            hub.unregister_assessor(execution_id)
        if schedule is not None:
            schedule.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await schedule
        await intermediate.close()
    made = tuple(intermediate.assessments)
    if run.cancelled:
        return result(Outcome.CANCELLED, None, run, made, detail="cancelled")
    if run.timed_out:
        outcome = Outcome.HARNESS_TIMEOUT
    elif run.exit_code == 0 and run.error is None:
        outcome = Outcome.COMPLETED
    else:
        outcome = Outcome.FAILED
    after = await _digest(workspace)
    calls: int | None = None
    if run.spawned and not run.timed_out and run.exit_code != 0 and after == setup_digest:
        calls = await _model_calls(hub, execution_id)
    infrastructure = infrastructure_failure(run, setup_digest, after, calls)
    if infrastructure is not None:
        nothing = placeholder(infrastructure)
        return result(Outcome.FAILED, 0.0, run, (*made, nothing), infrastructure)
    attempts = tuple(
        await assess(
            task.evaluator,
            workspace,
            deadline=overall_deadline,
            options=options,
            metadata=dict(task.metadata),
            reference=after,
            version=versions.version_of(after) if after else None,
            sandbox=confine,
        )
    )
    everything = (*made, *attempts)
    valid = final(attempts)
    if valid is not None:
        return result(outcome, valid.score, run, everything)
    if time.monotonic() >= overall_deadline:
        ended = "the overall budget ended before a valid assessment"
        return result(Outcome.OVERALL_TIMEOUT, None, run, everything, ended)
    why = attempts[-1].detail if attempts else "no evaluation attempt was made"
    return result(Outcome.FAILED, None, run, everything, f"no valid evaluation attempt: {why}")


def trace_record(
    task: Task,
    group: int,
    index: int,
    result: ExecutionResult,
    began: float,
    nodes: list[dict[str, Any]],
    start_wall: float,
    version: int | None = None,
) -> TraceRecord:
    """The execution's trace line; its calls' timings and token counts come from its tree.
    A call whose answer never reached the harness is not one of its calls (the harness
    retried it, and the retry is). ``version``: the policy version it launched with."""
    calls = [
        TraceCall(
            start_s=max(0.0, n["started_s"] - start_wall),
            end_s=max(0.0, n["finished_s"] - start_wall),
            input_tokens=n["usage"]["input_tokens"],
            output_tokens=n["usage"]["output_tokens"],
        )
        for n in nodes
        if n["delivered"]
    ]
    duration = result.ended_s - result.started_s
    return TraceRecord(
        query=task.id,
        group=group,
        index=index,
        start_s=began,
        end_s=began + duration,
        outcome=result.outcome,
        reward=result.reward,
        train_tokens=sum(c.output_tokens for c in calls),
        calls=calls,
        version=version,
    )
