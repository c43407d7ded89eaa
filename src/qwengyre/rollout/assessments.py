"""Intermediate assessments and the durable log of every assessment (the paper, §evaluation).

"An xLong execution may evaluate intermediate artifacts, revise them, and abandon
branches. Each assessment remains associated with its execution, artifact version, and
available branch reference; later assessments do not overwrite these associations. A
critique used by a subsequent policy request remains part of its input, but its
evaluator provenance excludes it from policy training targets."

Mechanism:

- :class:`ArtifactVersions` numbers the distinct workspace states of one execution:
  the first digest seen is version 1, each new digest the next number; a digest seen
  before keeps its number (the same artifact state is the same version).
- :class:`IntermediateAssessor` assesses an execution's workspace *now*, with the
  task's evaluator, while its harness runs: when the harness asks (the proxy's
  ``POST /x/{execution_id}/assess``, which calls :meth:`IntermediateAssessor.answer`,
  registered by :func:`~qwengyre.rollout.execution.run_execution` through an
  :class:`AssessmentHub`) and, if configured, every ``intermediate_every_s`` seconds
  (:meth:`IntermediateAssessor.periodic`).  Each result is an :class:`Assessment` of
  kind ``intermediate`` with its artifact version and digest (and, when the harness
  asked through the proxy, the branch reference: the id of the execution's latest
  recorded call).  Assessments are appended, never replaced, one at a time.  They never
  supply the reward: :func:`~qwengyre.rollout.evaluation.final` skips them; the final
  assessment after the harness ended gives the one reward.
- A critique the harness feeds back to the model is ordinary request input: the proxy
  records it as injected tokens (a node's ``input_ids``, provenance 0), whatever its
  role (user or assistant), so it is never a training target
  (:mod:`qwengyre.trajectories.selection`).
- Every assessment is kept in the run's assessment log
  (:mod:`qwengyre.records.assessments`). Intermediate assessments are held in memory
  until their execution ends and are written with its result, before the execution
  counts as finished: an execution whose runner died has no result and is not counted,
  so nothing that counted is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from qwengyre.records.assessments import Assessment
from qwengyre.rollout.evaluation import Evaluator, artifact_digest, evaluate_once
from qwengyre.rollout.sandbox import Sandbox

__all__ = [
    "ArtifactVersions",
    "AssessmentHub",
    "AssessmentUnavailable",
    "IntermediateAssessor",
    "critique_text",
]

"""The log's name in a run directory."""

Assessor = Callable[[int | None], Awaitable[Mapping[str, Any]]]
"""What the proxy calls for ``POST /x/{id}/assess``: ``branch`` -> the JSON answer."""


class AssessmentHub(Protocol):
    """What an execution needs from the proxy (:class:`qwengyre.proxy.server.ProxyServer`
    is one): registering its intermediate assessor, and its trajectory tree (to tell
    whether its harness made any model call)."""

    def register_assessor(self, execution_id: str, assessor: Assessor) -> None: ...

    def unregister_assessor(self, execution_id: str) -> None: ...

    async def tree(self, execution_id: str) -> Any: ...


class AssessmentUnavailable(LookupError):
    """No intermediate assessment can be made now (the harness ended, the budget is
    spent, the workspace cannot be read); the proxy answers it as a 404 with this
    message."""


class ArtifactVersions:
    """Version numbers of one execution's distinct artifact states (digests)."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def version_of(self, digest: str) -> int:
        """The digest's version: its earlier number, else the next one (from 1)."""
        if not digest:
            raise ValueError("an artifact version needs a digest")
        return self._numbers.setdefault(digest, len(self._numbers) + 1)

    def __len__(self) -> int:
        return len(self._numbers)


def critique_text(assessment: Assessment) -> str:
    """The critique to show a harness: the evaluator's own, else a one-line summary."""
    if assessment.critique:
        return assessment.critique
    version = f"artifact version {assessment.version}"
    if assessment.valid:
        return f"Assessment of {version}: score {assessment.score:.4g}."
    return f"Assessment of {version} is not valid: {assessment.detail}"


class IntermediateAssessor:
    """Assesses one execution's workspace while its harness runs (module docstring).

    ``deadline`` is the execution's overall deadline (:func:`time.monotonic`): no
    assessment starts after it, and each is cut to the time left.  ``versions`` is
    shared with the final assessment so that the same state keeps its number.
    ``sandbox``: the task's environment, where a command evaluator runs
    (:func:`~qwengyre.rollout.evaluation.evaluate_once`).
    """

    def __init__(
        self,
        spec: Evaluator,
        workspace: Path,
        *,
        deadline: float,
        versions: ArtifactVersions,
        metadata: dict[str, Any] | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        self.spec = spec
        self.sandbox = sandbox
        self.workspace = Path(workspace)
        self.deadline = deadline
        self.versions = versions
        self.metadata = dict(metadata or {})
        self.assessments: list[Assessment] = []
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[Assessment]] = set()
        self._closed = False

    async def assess_now(self, branch: int | None = None) -> Assessment:
        """Assess the workspace as it is now; the assessment is appended and returned.

        Raises :class:`AssessmentUnavailable` after :meth:`close`, past the deadline,
        or when the workspace cannot be read (e.g. changing under the digest); nothing
        is recorded then.  An evaluator failure is an invalid assessment, recorded.
        """
        if self._closed:
            raise AssessmentUnavailable("the execution's harness has ended")
        task = asyncio.ensure_future(self._assess(branch))
        self._running.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise AssessmentUnavailable(
                    "the execution's harness ended during the assessment"
                ) from None
            task.cancel()
            raise
        finally:
            self._running.discard(task)

    async def _assess(self, branch: int | None) -> Assessment:
        async with self._lock:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise AssessmentUnavailable("the execution's overall budget has ended")
            try:
                digest = await asyncio.to_thread(artifact_digest, self.workspace)
            except OSError as error:
                raise AssessmentUnavailable(f"the workspace cannot be read now: {error}") from None
            version = self.versions.version_of(digest)
            assessment = await evaluate_once(
                self.spec,
                self.workspace,
                metadata=self.metadata,
                timeout_s=remaining,
                attempt=len(self.assessments) + 1,
                artifact=digest,
                kind="intermediate",
                version=version,
                branch=branch,
                sandbox=self.sandbox,
            )
            self.assessments.append(assessment)
            return assessment

    async def answer(self, branch: int | None = None) -> dict[str, Any]:
        """The proxy endpoint's answer: ``score`` (None when invalid), ``valid``,
        ``critique``, ``artifact_version``, ``digest``, ``attempt`` and ``detail``."""
        assessment = await self.assess_now(branch)
        return {
            "score": assessment.score,
            "valid": assessment.valid,
            "critique": critique_text(assessment),
            "artifact_version": assessment.version,
            "digest": assessment.artifact,
            "attempt": assessment.attempt,
            "detail": assessment.detail,
            "evaluator": assessment.evaluator_name or assessment.evaluator,
        }

    async def periodic(self, every_s: float) -> None:
        """Assess every ``every_s`` seconds until cancelled (or the deadline); a moment
        when the workspace cannot be read is skipped."""
        while not self._closed:
            await asyncio.sleep(every_s)
            if time.monotonic() >= self.deadline:
                return
            try:
                await self.assess_now()
            except AssessmentUnavailable:
                continue

    async def close(self) -> None:
        """No more assessments: one in progress is cancelled (not recorded)."""
        self._closed = True
        running = list(self._running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
