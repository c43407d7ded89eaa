"""What the three workload formats share: reading a dataset line, running hidden tests on
a copy of the workspace, pytest's ``-rA`` report, and the grader's result line.

Grading never changes the workspace it grades: :func:`graded_copy` copies it (symlinks
kept as links) into a temporary directory, and the tests run there. So a retried
evaluation assesses the same preserved state (:func:`qwengyre.rollout.evaluation.assess`
re-digests the workspace before a retry), and an intermediate assessment leaves the
running harness's files alone.

A grader prints one JSON object as its last stdout line (:func:`result_line`):
``{"score": s, "valid": true, "critique": log}``, where ``log`` is at most
:data:`CRITIQUE_CHARS` characters -- a header naming what failed, then the *tail* of the
test output -- so it survives whole as the assessment's ``critique`` in
``assessments.jsonl``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from qwengyre.rollout.environments import EnvironmentSpec
from qwengyre.rollout.tasks import (
    TASK_ID_PATTERN,
    CommandEvaluator,
    Task,
    TaskFileError,
    read_record,
    read_records,
)

__all__ = [
    "CRITIQUE_CHARS",
    "GRADE_MARGIN_S",
    "DatasetLine",
    "TestReport",
    "critique",
    "graded_copy",
    "grader",
    "load_dataset",
    "pytest_command",
    "read_numbered_line",
    "result_line",
    "run_logged",
]

CRITIQUE_CHARS = 4000
"""The longest critique an assessment keeps (:mod:`qwengyre.rollout.evaluation` cuts
longer ones); :func:`critique` stays within it."""

M = TypeVar("M", bound=BaseModel)

GRADE_MARGIN_S = 120.0
"""What an evaluator's ``timeout_s`` adds to its tests' own timeout: time to copy the
workspace and apply patches. Tests that overrun their own timeout score 0 (a valid
assessment); a grader that overruns the evaluator's is killed (no valid assessment)."""


class DatasetLine(BaseModel):
    """The fields every JSONL workload line shares (``swe``, ``spec``).

    - ``id``: as a task's id (:data:`~qwengyre.rollout.tasks.TASK_ID_PATTERN`);
    - ``environment``: where the task's harness and grader run, the task's own
      :data:`~qwengyre.rollout.environments.EnvironmentSpec` (validated as a task's, a
      relative path resolving against the dataset file's directory);
    - ``metadata``: a free-form JSON object merged into the task's metadata;
    - ``test_command``: the argv that runs the hidden tests in the graded copy (default:
      :func:`pytest_command`); its output must carry pytest's ``-rA`` summary;
    - ``timeout_s``: the tests' own timeout (default 1800 s); past it they score 0.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[StrictStr, Field(pattern=TASK_ID_PATTERN)]
    environment: EnvironmentSpec | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    test_command: list[StrictStr] | None = None
    timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1800.0

    @field_validator("test_command")
    @classmethod
    def _check_command(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not value[0].strip()):
            raise ValueError("test_command must be a non-empty argv list")
        return value


def load_dataset(
    model: type[M], path: Path | str, to_task: Callable[[M, Path, int], Task], what: str
) -> list[Task]:
    """Every record of the JSONL dataset ``path`` (validated as ``model``) as a
    :class:`Task`, by ``to_task(record, path, line)``. Raises :class:`TaskFileError`
    naming the file, line and field of the first bad line, a duplicate id, or a file
    without ``what`` (e.g. "instances")."""
    path = Path(path)
    tasks = [to_task(record, path, line) for line, record in read_records(model, path)]
    if not tasks:
        raise TaskFileError(path, f"empty dataset: no {what}")
    return tasks


def read_numbered_line(model: type[M], path: Path, line: int, task_id: str) -> M:
    """Line ``line`` of ``path`` as ``model`` -- what a grader reads back of the line its
    task was loaded from. Raises :class:`TaskFileError` if that line is gone, invalid,
    or now holds another id (the dataset changed since it was loaded)."""
    try:
        with path.open(encoding="utf-8") as stream:
            text = next(itertools.islice(stream, line - 1, None), None)
    except OSError as error:
        raise TaskFileError(path, f"cannot open: {error.strerror or error}") from None
    if text is None:
        raise TaskFileError(path, "the line is gone: the dataset changed", line)
    record = read_record(model, text, path, line)
    if getattr(record, "id", None) != task_id:
        raise TaskFileError(path, f"no longer holds task {task_id!r}: the dataset changed", line)
    return record


def grader(kind: str, tests_timeout_s: float, *args: str | int | Path) -> CommandEvaluator:
    """A workload's command evaluator: this interpreter running
    :mod:`qwengyre.rollout.workloads.grade` ``kind`` ``args`` (run by
    :mod:`qwengyre.rollout.evaluation` with the workspace as its working directory),
    within the tests' own timeout plus :data:`GRADE_MARGIN_S`."""
    command = [sys.executable, "-m", "qwengyre.rollout.workloads.grade", kind]
    return CommandEvaluator(
        command=[*command, *(str(arg) for arg in args)],
        timeout_s=tests_timeout_s + GRADE_MARGIN_S,
    )


def pytest_command(*targets: str) -> list[str]:
    """The default test command: pytest on this interpreter, ``-rA`` (every test's
    outcome in the summary, what :class:`TestReport` reads), no cache written."""
    return [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *targets]


@contextlib.contextmanager
def graded_copy(workspace: Path) -> Iterator[Path]:
    """A temporary copy of ``workspace`` (symlinks kept), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="qwengyre-grade-") as scratch:
        copy = Path(scratch) / "workspace"
        shutil.copytree(workspace, copy, symlinks=True)
        yield copy


def run_logged(
    argv: Sequence[str],
    cwd: Path,
    timeout_s: float,
    *,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> tuple[int | None, str]:
    """Run ``argv`` in ``cwd`` in its own process group; ``(exit status, output)`` with
    stdout and stderr interleaved. The status is ``None`` when it ran past ``timeout_s``
    (its whole group killed). A program that cannot start raises ``OSError``: a grader
    that cannot run its tests gives no assessment, not a zero."""
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, f"{output}\n[killed after {timeout_s:g} s]"
    return proc.returncode, output


_STATUS_RE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (.+)$")
_PASSING = ("PASSED", "XFAIL")


@dataclass(frozen=True)
class TestReport:
    """Each test's outcome from pytest's ``-rA`` short summary (``PASSED nodeid``,
    ``FAILED nodeid - message``, ...), the last line per test winning. A test passes
    when its outcome is ``PASSED`` or ``XFAIL`` (as SWE-bench counts); a test absent from
    the summary did not pass."""

    __test__ = False  # not a pytest class

    outcomes: dict[str, str]

    @classmethod
    def parse(cls, output: str) -> TestReport:
        outcomes: dict[str, str] = {}
        for raw in output.splitlines():
            found = _STATUS_RE.match(raw.strip())
            if found is None:
                continue
            status, rest = found.groups()
            # Every outcome but PASSED may carry " - message" after the node id.
            node = rest if status == "PASSED" else rest.split(" - ", 1)[0]
            outcomes[node.strip()] = status
        return cls(outcomes)

    def passed(self, test: str) -> bool:
        """Whether ``test`` (a node id) passed."""
        return self.outcomes.get(test) in _PASSING

    def failing(self, tests: Sequence[str]) -> list[str]:
        """Those of ``tests`` that did not pass, in order."""
        return [test for test in tests if not self.passed(test)]


def critique(header: Sequence[str], output: str) -> str:
    """The grader's log: ``header`` lines, then the tail of ``output``, at most
    :data:`CRITIQUE_CHARS` characters in all (a long header is cut first)."""
    head = "\n".join(header)[: CRITIQUE_CHARS // 2]
    room = CRITIQUE_CHARS - len(head) - len("\n--- output (tail) ---\n...")
    output = output.strip()
    tail = output if len(output) <= room else "..." + output[-room:]
    return f"{head}\n--- output (tail) ---\n{tail}"


def result_line(score: float, log: str, *, valid: bool = True) -> str:
    """The grader's last stdout line: ``{"score", "valid", "critique"}`` as JSON."""
    return json.dumps({"score": score, "valid": valid, "critique": log[:CRITIQUE_CHARS]})
