"""The assessment log (``assessments.jsonl``): every assessment of every execution --
final attempts, intermediate ones, placeholders -- as JSON lines in the run directory.

One JSON object per line, one line per assessment, lines of an execution in the order
its assessments were made::

    {"execution_id": "ex_...", "task_id": "add-1", "group": 0, "index": 3,
     "score": 1.0, "valid": true, "artifact": "<sha256>", "attempt": 1,
     "evaluator": "command", "detail": "ok", "placeholder": false, "kind": "final",
     "version": 2, "evaluator_name": "python grade.py", "branch": null,
     "critique": "", "time_s": 1760000000.0, "duration_s": 0.4}

(the keys after ``index`` are :meth:`Assessment.to_dict`).  Each :meth:`AssessmentLog.write`
appends its lines in one write and ``fsync`` s them before it returns; :func:`read_assessments`
reads them back. How assessments are made: :mod:`qwengyre.rollout.evaluation` and
:mod:`qwengyre.rollout.assessments`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwengyre.durable import LineLog

ASSESSMENTS_FILE = "assessments.jsonl"

#: The kinds of assessment: ``final`` (an evaluation attempt after the harness ended),
#: ``intermediate`` (while it runs), ``placeholder`` (a complete failure's zero).
KINDS: tuple[str, ...] = ("final", "intermediate", "placeholder")


@dataclass(kw_only=True, frozen=True)
class Assessment:
    """One assessment: an evaluation attempt's result, kept with its execution.

    - ``score``: a finite float when ``valid``, else ``None`` (an invalid assessment has
      no score -- in particular it is not 0);
    - ``artifact``: the :func:`artifact_digest` of the workspace state assessed (``""``
      only for a placeholder, or an attempt that could not read the workspace at all);
    - ``attempt``: 1-based attempt number (0 for a placeholder); for intermediate
      assessments, their 1-based sequence number within the execution;
    - ``evaluator``: the evaluator kind (``command``, ``python``, ``exact_match``, ``model``,
      ``placeholder``); ``evaluator_name`` names it (:func:`evaluator_name`);
    - ``detail``: ``"ok"`` or why the attempt is invalid (timeout, bad output,
      exception, ...), plus why retrying stopped where that applies; for a placeholder,
      the reason for the failure;
    - ``placeholder``: the zero-reward stand-in for a complete failure (:func:`placeholder`);
    - ``kind``: ``final`` | ``intermediate`` | ``placeholder`` (:data:`KINDS`);
      ``placeholder`` <=> ``kind == "placeholder"`` (either one sets the other);
    - ``version``: the artifact version (1-based, one per distinct digest within the
      execution: :class:`qwengyre.rollout.assessments.ArtifactVersions`); always set on
      intermediate assessments, set on final ones by :func:`run_execution
      <qwengyre.rollout.execution.run_execution>`, ``None`` where unknown;
    - ``branch``: the available branch reference -- the id of the execution's latest
      recorded model call (trajectory-tree node) when the harness asked for the
      assessment through the proxy -- else ``None``;
    - ``critique``: feedback text the evaluator returned (``""`` if none);
    - ``time_s``: wall-clock time (:func:`time.time`) the assessment finished;
      ``duration_s``: how long it took.

    ``__post_init__`` enforces: ``valid`` <=> ``score`` is a finite float (an ``int`` is
    converted, a ``bool`` refused); a valid non-placeholder names its artifact;
    ``placeholder`` => valid, ``score == 0.0`` and ``artifact == ""``; an intermediate
    assessment has a version.
    """

    score: float | None
    valid: bool
    artifact: str
    attempt: int
    evaluator: str
    detail: str
    placeholder: bool = False
    kind: str = "final"
    version: int | None = None
    evaluator_name: str = ""
    branch: int | None = None
    critique: str = ""
    time_s: float = 0.0
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.valid, bool) or not isinstance(self.placeholder, bool):
            raise TypeError("valid and placeholder must be bools")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.placeholder and self.kind == "final":
            object.__setattr__(self, "kind", "placeholder")
        elif self.kind == "placeholder" and not self.placeholder:
            object.__setattr__(self, "placeholder", True)
        if self.placeholder and self.kind != "placeholder":
            raise ValueError(f"a placeholder has kind 'placeholder', not {self.kind!r}")
        score = self.score
        if isinstance(score, bool):
            raise TypeError("score must be a float or None, not a bool")
        if isinstance(score, int):
            score = float(score)
            object.__setattr__(self, "score", score)
        if score is not None and not isinstance(score, float):
            raise TypeError(f"score must be a float or None, got {type(score).__name__}")
        finite = score is not None and math.isfinite(score)
        if self.valid and not finite:
            raise ValueError(f"a valid assessment needs a finite score, got {score!r}")
        if not self.valid and score is not None:
            raise ValueError(
                f"an invalid assessment has no score (got {score!r}); it is never a number"
            )
        for name in ("attempt", "version", "branch"):
            value = getattr(self, name)
            if value is None and name != "attempt":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")
        if self.version is not None and self.version < 1:
            raise ValueError(f"version must be >= 1, got {self.version}")
        if self.kind == "intermediate" and self.version is None:
            raise ValueError("an intermediate assessment needs its artifact version")
        for name in ("artifact", "detail", "evaluator", "evaluator_name", "critique"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string")
        if self.placeholder:
            if not self.valid or score != 0.0:
                raise ValueError("a placeholder is valid with score 0.0")
            if self.artifact:
                raise ValueError("a placeholder assesses no artifact (artifact must be '')")
        elif self.valid and not self.artifact:
            raise ValueError("a valid assessment must name the artifact state it assessed")

    def to_dict(self) -> dict[str, Any]:
        """The assessment as a JSON-ready dict (for durable records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Assessment:
        """The inverse of :meth:`to_dict`; unknown keys are refused (``TypeError``)."""
        return cls(**data)


@dataclass(kw_only=True, frozen=True)
class AssessmentRecord:
    """One line of the log: an assessment and the execution it belongs to."""

    execution_id: str
    task_id: str
    group: int
    index: int
    assessment: Assessment

    def to_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "task_id": self.task_id,
            "group": self.group,
            "index": self.index,
            **self.assessment.to_dict(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AssessmentRecord:
        fields = dict(data)
        return cls(
            execution_id=str(fields.pop("execution_id")),
            task_id=str(fields.pop("task_id", "")),
            group=int(fields.pop("group")),
            index=int(fields.pop("index")),
            assessment=Assessment.from_dict(fields),
        )


class AssessmentLog:
    """Appends every assessment of an execution to ``path`` (JSON lines, fsync'd, all
    of one call or none: :class:`~qwengyre.durable.LineLog`).

    Safe to call from several tasks or threads (one lock); the file is opened for each
    write, so the log holds no descriptor between executions.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def write(
        self,
        execution_id: str,
        group: int,
        index: int,
        assessments: Iterable[Assessment],
        *,
        task_id: str = "",
    ) -> int:
        """Append one line per assessment, in order, durable on return; how many."""
        records = [
            AssessmentRecord(
                execution_id=execution_id, task_id=task_id, group=group, index=index, assessment=a
            )
            for a in assessments
        ]
        if not records:
            return 0
        data = "\n".join(json.dumps(r.to_json(), allow_nan=False) for r in records)
        with self._lock:
            log = LineLog(self.path, "the assessments log", fsync=True)
            try:
                log.append(data)
            finally:
                log.close()
        return len(records)


def read_assessments(path: Path | str) -> list[AssessmentRecord]:
    """Every record of a log, in file order (``[]`` if there is no file).

    A last line cut short by a crash mid-write (no newline, not JSON) is ignored; any
    other bad line raises ``ValueError`` naming ``file:line``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    records: list[AssessmentRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn = number == len(lines)  # the last piece had no newline after it
        try:
            records.append(AssessmentRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as error:
            if torn:
                break
            raise ValueError(f"{path}:{number}: not an assessment record: {error}") from None
    return records
